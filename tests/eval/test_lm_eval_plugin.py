"""The lm-evaluation-harness plugin: through lm-eval's own evaluator and archlab's shipped task
configs, the same items get the same per-choice log-likelihoods and the same picks as
``archlab eval``; rolling log-likelihood and generation against direct computations."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

lm_eval = pytest.importorskip("lm_eval")

from archlab.eval.harness import evaluate_tasks  # noqa: E402
from archlab.eval.lm_eval_plugin import ArchlabLM, task_config_dir  # noqa: E402
from archlab.eval.tasks import TASK_DIR_ENV, load_tasks  # noqa: E402
from tests.eval.conftest import mc_items  # noqa: E402


@pytest.fixture(scope="module")
def task_dir(words, tmp_path_factory) -> Path:
    """piqa (uniform fields, choices the memorised model knows), winogrande and copa (native
    fields) and lambada: four tasks, three kinds of request."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    with open(root / "piqa.jsonl", "w") as f:
        for it in mc_items(words)[:6]:
            f.write(json.dumps({"context": it.context, "continuations": list(it.continuations), "gold": it.gold}) + "\n")
    with open(root / "winogrande.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"sentence": f"This module implements _ container datatypes {i}.",
                                "option1": "specialized", "option2": "general", "answer": "1"}) + "\n")
    with open(root / "copa.jsonl", "w") as f:
        f.write(json.dumps({"premise": "This module implements containers.", "choice1": "Dict, list, set.",
                            "choice2": "Python's general purpose.", "question": "cause", "label": 1}) + "\n")
    with open(root / "lambada.jsonl", "w") as f:
        for k in (4, 9, 15):
            f.write(json.dumps({"context": " ".join(words[:k]), "target": words[k]}) + "\n")
    return root


def test_plugin_equals_the_evaluator_item_by_item(trained_model, tokenizer, task_dir, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv(TASK_DIR_ENV, str(task_dir))
    names = ["piqa", "winogrande", "copa", "lambada"]
    records: dict = {}
    ours = evaluate_tasks(trained_model, tokenizer, load_tasks(names, task_dir), batch_size=4, records=records)
    manager = TaskManager(include_path=str(task_config_dir()), include_defaults=False)
    out = lm_eval.simple_evaluate(model=ArchlabLM(model=trained_model, tokenizer=tokenizer, batch_size=3),
                                  tasks=[f"archlab_{n}" for n in names], task_manager=manager, log_samples=True)
    for name in names:
        samples = sorted(out["samples"][f"archlab_{name}"], key=lambda s: s["doc_id"])
        assert len(samples) == len(records[name]) == ours[name]["n"]
        for sample, rec in zip(samples, records[name]):
            lls = [r[0][0] for r in sample["resps"]]
            if name == "lambada":
                assert lls == pytest.approx([rec["loglikelihood"]], abs=1e-5)
                assert sample["resps"][0][0][1] == rec["greedy"]
                continue
            assert lls == pytest.approx(rec["loglikelihoods"], abs=1e-5)
            assert sample["doc"]["gold"] == rec["gold"]
            assert sample["acc"] == float(rec["pred"] == rec["gold"])
            if "acc_norm" in sample:  # lm-eval's own acc_norm decides as archlab's does, item by item
                assert sample["acc_norm"] == float(rec["pred_norm"] == rec["gold"])
        res = out["results"][f"archlab_{name}"]
        assert res["acc,none"] == pytest.approx(ours[name]["acc"])
        if name in ("piqa", "copa"):
            assert res["acc_norm,none"] == pytest.approx(ours[name]["acc_norm"])
    assert ours["piqa"]["acc"] == 1.0  # the model knows its sentence: the comparison is not of noise
    assert out["results"]["archlab_lambada"]["perplexity,none"] == pytest.approx(ours["lambada"]["ppl"], rel=1e-5)


class _Req:
    def __init__(self, *args):
        self.args = args


def test_rolling_loglikelihood_equals_a_direct_sum(trained_model, tokenizer, sentence):
    lm = ArchlabLM(model=trained_model, tokenizer=tokenizer, batch_size=2)
    short = sentence[:40]
    longer = (sentence + " ") * 3  # about 160 tokens: several 64-token windows
    got = lm.loglikelihood_rolling([_Req(short), _Req(longer)])
    ids = tokenizer.encode(short, add_special_tokens=False).ids
    with torch.no_grad():
        logp = F.log_softmax(trained_model(torch.tensor([[0] + ids[:-1]])).logits[0].float(), -1)
    assert got[0] == pytest.approx(float(logp[torch.arange(len(ids)), torch.tensor(ids)].sum()), abs=1e-4)
    # the long text: disjoint windows of at most 64 tokens, each predicted from its own start
    ids = tokenizer.encode(longer, add_special_tokens=False).ids
    total, seq = 0.0, [0] + ids
    for start in range(0, len(ids), 64):
        # a window predicts ids[start:end] from the 64 tokens before its end (the last one's
        # context reaches back into the window before it)
        end = min(start + 64, len(ids))
        inp = seq[max(0, end - 64):end]
        with torch.no_grad():
            lp = F.log_softmax(trained_model(torch.tensor([inp])).logits[0].float(), -1)
        n = end - start
        total += float(lp[torch.arange(len(inp) - n, len(inp)), torch.tensor(seq[start + 1:end + 1])].sum())
    assert len(ids) > 128 and got[1] == pytest.approx(total, abs=1e-3)
    assert math.isfinite(got[1])


def test_generate_until_is_greedy_and_stops_at_the_stop_string(trained_model, tokenizer, words):
    lm = ArchlabLM(model=trained_model, tokenizer=tokenizer, batch_size=2, max_gen_toks=24)
    prompts = [" ".join(words[:3]), " ".join(words[:8])]
    texts = lm.generate_until([_Req(prompts[0], {"until": [" general"], "max_gen_toks": 24}),
                               _Req(prompts[1], {"until": ["zzz"], "max_gen_toks": 6})])
    # the memorised sentence continues greedily; the first stops before " general"
    assert texts[0] == " " + " ".join(words[3:words.index("general")])
    # the second runs its 6 tokens: the same as a direct greedy loop with full forwards
    ids = tokenizer.encode(prompts[1], add_special_tokens=False).ids
    for _ in range(6):
        with torch.no_grad():
            ids.append(int(trained_model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert texts[1] == tokenizer.decode(ids[-6:])


def test_archlab_lm_eval_command_hands_over_with_archlab_configs(monkeypatch, tmp_path):
    """``archlab lm-eval``: archlab's --task-dir is taken out and exported, the shipped configs go on
    lm-eval's include path, the rest reaches lm-eval's own parser unchanged."""
    from lm_eval.tasks import TaskManager

    import archlab.eval.lm_eval_plugin as plugin

    seen = {}
    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", lambda: seen.setdefault("argv", list(sys.argv)))
    monkeypatch.delenv(TASK_DIR_ENV, raising=False)
    assert plugin.run_lm_eval(["--model", "archlab", "--task-dir", str(tmp_path), "--tasks", "archlab_piqa"]) == 0
    assert seen["argv"] == ["lm-eval", "--model", "archlab", "--tasks", "archlab_piqa", "--include_path",
                            str(task_config_dir())]
    assert os.environ[TASK_DIR_ENV] == str(tmp_path)
    # every task the issue names has a config lm-eval can index
    listed = TaskManager(include_path=str(task_config_dir()), include_defaults=False).all_tasks
    assert {f"archlab_{n}" for n in ("hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande", "lambada",
                                     "sciq", "copa", "openbookqa")} <= set(listed)


def test_missing_task_data_names_the_folder(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    from archlab.errors import DataError

    monkeypatch.setenv(TASK_DIR_ENV, str(tmp_path))
    manager = TaskManager(include_path=str(task_config_dir()), include_defaults=False)
    with pytest.raises(DataError, match="no data for task 'sciq'.*sciq/none/validation"):
        manager.load(["archlab_sciq"])


def test_acc_norm_is_lm_evals_own_on_items_where_the_denominator_decides(task_dir, monkeypatch):
    """lm-eval's process_results on the shipped config, against archlab's metrics, with the same
    log-likelihoods, on items where characters against bytes or the leading space flip the pick."""
    from lm_eval.tasks import TaskManager

    from archlab.eval.harness import Score, evaluate_mc
    from archlab.eval.items import MCItem
    from archlab.eval.lm_eval_tasks.archlab_docs import item_doc

    monkeypatch.setenv(TASK_DIR_ENV, str(task_dir))
    task = TaskManager(include_path=str(task_config_dir()), include_defaults=False).load(["archlab_piqa"])
    task = task["tasks"]["archlab_piqa"] if "tasks" in task else task["archlab_piqa"]
    cases = [(MCItem("Q:", (" ab", " abcd"), 1), [-2.0, -3.5]),  # the leading space decides
             (MCItem("Q:", (" ééé", " abcd"), 1), [-3.0, -3.2]),  # characters against bytes decide
             (MCItem("Q:", (" ééé", " abcd"), 0), [-3.0, -3.2])]
    for item, lls in cases:
        theirs = task.process_results(item_doc(item), [(lp, False) for lp in lls])
        ours = evaluate_mc([item], lambda reqs, lls=lls: [Score(lp, False, 1) for lp in lls])
        assert theirs["acc_norm"] == ours["acc_norm"] and theirs["acc"] == ours["acc"]
        assert ours["acc_norm"] != ours["acc_per_byte"]  # the old per-byte pick would differ


def _option_cfg(option: str, vocab: int):
    from tests.helpers import tiny_model_cfg

    cfg = tiny_model_cfg(vocab_size=vocab, n_layers=3)
    if option == "branch":
        cfg.branch.enabled = True
    elif option == "hidden_decoding":
        cfg.hidden_decoding.enabled = True
    return cfg.validate()


@pytest.mark.parametrize("option", ["baseline", "branch", "hidden_decoding"])
def test_every_request_type_on_model_options(option, tokenizer, sentence):
    """Scores are the model's readout (a branch model's mixture), generation is the engine's cached
    decoding: both against full forwards of the same random model."""
    from archlab.model import build_model

    torch.manual_seed(3)
    model = build_model(_option_cfg(option, tokenizer.get_vocab_size())).eval()
    lm = ArchlabLM(model=model, tokenizer=tokenizer, batch_size=2)

    def log_probs(ids):
        with torch.no_grad():
            return model.log_probs(model(torch.tensor([ids])))[0].float()

    ctx, cont = sentence[:30], sentence[30:45]
    (got,) = lm.loglikelihood([_Req(ctx, cont)])
    c_ids, x_ids = lm.scorer.encode_pair(ctx, cont)
    lp = log_probs(c_ids + x_ids[:-1])[-len(x_ids):]
    assert got[0] == pytest.approx(float(lp[torch.arange(len(x_ids)), torch.tensor(x_ids)].sum()), abs=1e-4)
    (text,) = lm.generate_until([_Req(ctx, {"until": ["\u2603"], "max_gen_toks": 5})])
    ids = tokenizer.encode(ctx, add_special_tokens=False).ids
    for _ in range(5):
        ids.append(int(log_probs(ids)[-1].argmax()))
    assert text == tokenizer.decode(ids[-5:])


def test_bad_model_args_are_one_line_usage_errors(trained_model, tokenizer):
    from archlab.errors import UsageError

    for kwargs, words in [({}, "pretrained=RUN_OR_CHECKPOINT_DIR"), ({"pretrained": "x", "temperature": 1},
                                                                      "unknown model_args temperature"),
                          ({"model": trained_model, "tokenizer": tokenizer, "batch_size": "0"}, "batch_size must be"),
                          ({"model": trained_model}, "needs its tokenizer")]:
        with pytest.raises(UsageError, match=words) as e:
            ArchlabLM(**kwargs)
        assert e.value.exit_code == 2 and "\n" not in str(e.value)
    assert ArchlabLM(model=trained_model, tokenizer=tokenizer, batch_size="auto:4").batch_size == 8
