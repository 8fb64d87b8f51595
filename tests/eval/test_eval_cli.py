"""``archlab eval --tasks``: JSON and table output, --limit, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_cli
from tests.eval.conftest import lambada_items, mc_items
from tests.eval.test_tasks import PIQA, write_save_to_disk


@pytest.fixture(scope="module")
def ckpt(trained_model, tokenizer, tmp_path_factory) -> Path:
    from archlab.config import RunConfig
    from archlab.io.checkpoint import save_model

    root = tmp_path_factory.mktemp("ckpt")
    tokenizer.save(str(root / "tokenizer.json"))
    cfg = RunConfig(model=trained_model.cfg)
    cfg.train.seq_len = 32
    return save_model(root / "model", trained_model, cfg.validate(), root / "tokenizer.json")


@pytest.fixture(scope="module")
def task_dir(words, tmp_path_factory) -> Path:
    """piqa as JSONL (uniform fields), lambada as JSONL, hellaswag as a real-format folder."""
    root = tmp_path_factory.mktemp("tasks")
    with open(root / "piqa.jsonl", "w") as f:
        for it in mc_items(words):
            f.write(json.dumps({"context": it.context, "continuations": list(it.continuations), "gold": it.gold}) + "\n")
    with open(root / "lambada.jsonl", "w") as f:
        for it in lambada_items(words):
            f.write(json.dumps({"context": it.context, "target": it.target}) + "\n")
    write_save_to_disk(root / "arc_easy_bad", PIQA, "piqa")  # piqa rows where arc_easy is expected
    return root


def test_eval_tasks_json(ckpt, task_dir, capsys):
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(ckpt), "--tasks", "piqa,lambada", "--task-dir",
                             str(task_dir), "--json", "--device", "cpu")
    assert code == 0, err
    res = json.loads(out)
    assert res["checkpoint"] == str(ckpt)
    piqa, lam = res["tasks"]["piqa"], res["tasks"]["lambada"]
    assert piqa["n"] == 14 and piqa["acc"] == 1.0 and piqa["acc_norm"] == 1.0 and piqa["acc_stderr"] == 0.0
    assert lam["n"] == 16 and lam["acc"] == 1.0 and lam["ppl"] < 1.2


def test_eval_tasks_limit_and_table(ckpt, task_dir, capsys):
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(ckpt), "--tasks", "piqa", "--task-dir", str(task_dir),
                             "--limit", "3", "--batch-size", "2", "--device", "cpu")
    assert code == 0, err
    assert "piqa" in out and "1.0000 ± 0.0000" in out
    row = [line for line in out.splitlines() if "piqa" in line][0]
    assert " 3 " in row


def test_eval_task_errors_are_one_line(ckpt, task_dir, capsys):
    cases = [
        (["--tasks", "piqa,mmlu", "--task-dir", str(task_dir)], ["unknown task 'mmlu'"]),
        (["--tasks", "hellaswag", "--task-dir", str(task_dir)], ["no data for task 'hellaswag'"]),
        (["--tasks", f"arc_easy={task_dir / 'arc_easy_bad'}"], ["row 0", "question, choices, answerKey"]),
        (["--tasks", "piqa", "--task-dir", str(task_dir / "missing")], ["does not exist"]),
        (["--limit", "3"], ["apply to --tasks"]),
    ]
    for extra, words in cases:
        code, out, err = run_cli(capsys, "eval", "--ckpt", str(ckpt), *extra)
        assert code == 1, (extra, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        for w in words:
            assert w in lines[0], lines[0]


def test_eval_tasks_needs_the_checkpoint_tokenizer(trained_model, task_dir, tmp_path, capsys):
    from archlab.config import RunConfig
    from archlab.io.checkpoint import save_model

    cfg = RunConfig(model=trained_model.cfg)
    cfg.train.seq_len = 32
    bare = save_model(tmp_path / "bare", trained_model, cfg.validate())
    code, _, err = run_cli(capsys, "eval", "--ckpt", str(bare), "--tasks", "piqa", "--task-dir", str(task_dir))
    assert code == 1 and "no tokenizer.json" in err and len(err.strip().splitlines()) == 1


def test_evaluate_checkpoint_matches_the_cli(ckpt, task_dir, capsys):
    """The shared code path (``archlab eval --tasks`` and the lab's suites): same numbers, and a
    progress callback that counts every scored request."""
    from archlab.eval.harness import evaluate_checkpoint, n_requests
    from archlab.eval.tasks import load_tasks

    loaded = load_tasks("piqa,lambada", task_dir, 5)
    seen: list[int] = []
    results, where = evaluate_checkpoint(ckpt, loaded, batch_size=3, progress=seen.append)
    assert where == ckpt and sum(seen) == sum(n_requests(v) for v in loaded.values()) == 5 * 3 + 5
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(ckpt), "--tasks", "piqa,lambada", "--task-dir",
                             str(task_dir), "--limit", "5", "--json", "--device", "cpu")
    assert code == 0, err
    tasks = json.loads(out)["tasks"]
    assert {name: r.pop("split") for name, r in tasks.items()} == {"piqa": "file", "lambada": "file"}
    assert tasks["piqa"].pop("source") == str(task_dir / "piqa.jsonl")
    tasks["lambada"].pop("source")
    assert tasks == json.loads(json.dumps(results))


def test_eval_output_items_split_and_a_nested_task_dir(ckpt, task_dir, tmp_path, capsys):
    """--task-dir is searched below its top folder; --output-items holds every choice's score."""
    from archlab.eval.harness import Scorer
    from archlab.eval.tasks import load_task

    nested = tmp_path / "a" / "b" / "validation"
    nested.mkdir(parents=True)
    (nested / "piqa.jsonl").write_text((task_dir / "piqa.jsonl").read_text())
    out_file = tmp_path / "items.jsonl"
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(ckpt), "--tasks", "piqa", "--task-dir", str(tmp_path),
                             "--limit", "4", "--json", "--device", "cpu", "--output-items", str(out_file))
    assert code == 0, err
    res = json.loads(out)["tasks"]["piqa"]
    assert res["split"] == "validation" and res["source"] == str(nested / "piqa.jsonl")
    lines = [json.loads(line) for line in out_file.read_text().splitlines()]
    items = load_task("piqa", nested / "piqa.jsonl", 4)
    assert [(r["task"], r["split"], r["item"], r["gold"]) for r in lines] == [
        ("piqa", "validation", i, it.gold) for i, it in enumerate(items)]
    from archlab.data.tokenizer import load_tokenizer
    from archlab.io.checkpoint import load_model

    model, _, _ = load_model(ckpt, "cpu")
    scorer = Scorer(model.eval(), load_tokenizer(ckpt / "tokenizer.json"))
    for rec, it in zip(lines, items):
        expect = [s.logprob for s in scorer(it.pairs())]
        assert rec["loglikelihoods"] == pytest.approx(expect, abs=1e-5)
        assert rec["pred"] == max(range(len(expect)), key=expect.__getitem__) == it.gold
    code, _, err = run_cli(capsys, "eval", "--ckpt", str(ckpt), "--tasks", "piqa", "--task-dir", str(tmp_path),
                           "--output-items", str(tmp_path / "missing" / "x.jsonl"))
    assert code == 2 and "folder does not exist" in err and len(err.strip().splitlines()) == 1


def test_lm_eval_command_without_lm_eval_installed_is_one_line(monkeypatch, capsys):
    import sys

    # what a missing package looks like to import, even after another test imported it
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")] or ["lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "archlab.eval.lm_eval_plugin", raising=False)
    code, _, err = run_cli(capsys, "lm-eval", "--model", "archlab", "--tasks", "archlab_piqa")
    assert code == 2 and "pip install 'lm-eval>=0.4.13'" in err and len(err.strip().splitlines()) == 1
