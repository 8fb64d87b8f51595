"""Extra evaluation corpora (eval_data): the trainer's own evaluation on another directory, the
tokenizer check, and the suite-side bookkeeping (stored once, reported next to the in-distribution loss)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from rich.console import Console

import archlab.lab.heldout as heldout
from archlab.errors import ConfigError
from archlab.lab.plan import build_plan
from archlab.lab.report import collect, heldout_table, write_report
from archlab.lab.runner import run_suite
from archlab.lab.store import DB_NAME, ResultStore
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import SUITE_YAML, FakeTrainer, fake_costs, write_suite


def quiet() -> Console:
    return Console(file=open(os.devnull, "w"), width=200)


def test_heldout_loss_is_the_trainers_evaluation(tiny_run: Path, stdlib_data: Path) -> None:
    """On the run's own corpus the held-out loss is the trainer's last validation loss exactly."""
    from archlab.io.checkpoint import load_model
    from archlab.train.trainer import read_curves

    _, cfg, _ = load_model(tiny_run)
    _, val = read_curves(tiny_run)
    loss, bpb, batches = heldout.evaluate_heldout(tiny_run, cfg, str(stdlib_data))
    assert loss == pytest.approx(val[-1]["loss"], rel=1e-5)
    assert bpb == pytest.approx(val[-1]["bpb"], rel=1e-5)
    assert batches == cfg.train.eval_batches


def test_another_tokenizer_is_one_clear_line(tiny_run: Path, stdlib_data: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(stdlib_data, other)
    (other / "tokenizer.json").write_bytes((other / "tokenizer.json").read_bytes() + b" ")
    tok = heldout.ckpt_tokenizer(tiny_run)
    assert heldout.check_tokenizer("s.yaml", "same", str(stdlib_data), tok)  # identical: fine
    with pytest.raises(ConfigError, match=r"^suite error: s.yaml: eval_data.other: .* another tokenizer") as e:
        heldout.check_tokenizer("s.yaml", "other", str(other), tok)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="not a prepared data directory"):
        heldout.check_tokenizer("s.yaml", "gone", str(tmp_path / "nothing"), tok)


def _corpus(path: Path, tokenizer: bytes = b'{"fake": 1}') -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    (path / "tokenizer.json").write_bytes(tokenizer)
    return path


def test_suite_evaluates_each_finished_run_once_per_corpus(tmp_path: Path, monkeypatch) -> None:
    run_tok = _corpus(tmp_path / "train-tok")  # stands in for the tokenizer in every checkpoint
    _corpus(tmp_path / "wiki")
    _corpus(tmp_path / "code")
    monkeypatch.setattr(heldout, "ckpt_tokenizer", lambda run_dir: run_tok / "tokenizer.json")
    calls: list[tuple[str, str]] = []

    def fake(run_dir: Path, cfg, data_path: str) -> tuple[float, float, int]:
        calls.append((run_dir.name, Path(data_path).name))
        return 4.0 + 10 * (cfg.model.init_std - 0.02) + (0.5 if data_path.endswith("code") else 0.0), 1.0, 2

    monkeypatch.setattr(heldout, "evaluate_heldout", fake)
    text = SUITE_YAML + "eval_data: {wiki: wiki}\n"
    plan = build_plan(load_suite(write_suite(tmp_path, text)), tmp_path / "o", costs_fn=fake_costs)
    assert plan.suite.eval_data == {"wiki": str(tmp_path / "wiki")}  # relative to the suite file
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet())
    assert sorted(calls) == sorted((r.run_id, "wiki") for r in plan.runs)
    # A corpus added later: only it is evaluated, nothing is retrained.
    calls.clear()
    text2 = SUITE_YAML + "eval_data: {wiki: wiki, code: code}\n"
    plan2 = build_plan(load_suite(write_suite(tmp_path, text2)), tmp_path / "o", costs_fn=fake_costs)
    trainer = FakeTrainer()
    with ResultStore(plan2.out_dir / DB_NAME) as store:
        run_suite(plan2, store, list(plan2.runs), train_fn=trainer, console=quiet())
        data = collect(store)
    assert trainer.calls == [] and sorted(calls) == sorted((r.run_id, "code") for r in plan.runs)
    header, rows = heldout_table(data)
    assert header == ["variant", "val loss (in distribution)", "code loss", "wiki loss"]  # sorted
    by = {r[0]: r for r in rows}
    assert by["llama"][3] == "4.0000" and by["lower-init"][3] == "3.9000 (-0.1000)"
    assert by["lower-init"][2] == "4.4000 (-0.1000)"
    md, _ = write_report(plan2.out_dir)
    assert "## Held-out corpora" in md.read_text()


def test_a_corpus_with_another_tokenizer_fails_before_training(tmp_path: Path) -> None:
    data = _corpus(tmp_path / "train-data")  # the runs' corpus, already prepared
    _corpus(tmp_path / "wiki", tokenizer=b"other")
    text = SUITE_YAML.replace("/nonexistent-data", str(data)) + "eval_data: {wiki: wiki}\n"
    plan = build_plan(load_suite(write_suite(tmp_path, text)), tmp_path / "o", costs_fn=fake_costs)
    trainer = FakeTrainer()
    with ResultStore(plan.out_dir / DB_NAME) as store:
        with pytest.raises(ConfigError, match="eval_data.wiki: .* another tokenizer"):
            run_suite(plan, store, list(plan.runs), train_fn=trainer, console=quiet())
    assert trainer.calls == []


def test_heldout_rows_belong_to_finished_runs_and_are_never_replaced(tmp_path: Path) -> None:
    import sqlite3

    from archlab.lab.store import HeldoutRow
    from tests.lab.test_lab_store import result, start

    def row(run_id: str, loss: float) -> HeldoutRow:
        return HeldoutRow(run_id=run_id, corpus="wiki", path="/w", tokenizer_sha="ab", loss=loss, bpb=1.0,
                          batches=2, evaluated_at=1.0)

    with ResultStore(tmp_path / "r.sqlite") as store:
        store.start_run(start("a"))
        store.start_run(start("b"))
        store.finish_run("a", result(), final_val_loss=2.5, final_val_bpb=1.1)
        store.add_heldout([row("a", 3.5)])
        store.add_heldout([row("a", 9.9)])  # a second evaluation (another compare): the first stays
        assert [(h.run_id, h.loss) for h in store.heldout()] == [("a", 3.5)]
        with pytest.raises(sqlite3.IntegrityError, match="finished run"):
            store.add_heldout([row("b", 3.0)])
