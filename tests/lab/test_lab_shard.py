"""A suite split across machines without a shared database: ``compare --shard I/N`` into one
directory per machine, then ``archlab merge`` (archlab.lab.merge)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from archlab.cli import main
from archlab.config import RunConfig
from archlab.errors import ArchlabError, ConfigError
from archlab.lab.cli import run_compare, run_merge
from archlab.lab.display import RUNS_DIR
from archlab.lab.plan import build_plan, parse_shard, shard_ids
from archlab.lab.report import write_report
from archlab.lab.runner import run_suite
from archlab.lab.store import DB_NAME, ResultStore
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import SUITE_YAML, FakeTrainer, fake_costs, write_suite


def quiet() -> Console:
    return Console(file=open(os.devnull, "w"), width=300)


def recording() -> Console:
    return Console(record=True, width=300, file=open(os.devnull, "w"))


def args(suite: Path, out: Path, **kw: object) -> argparse.Namespace:
    base = dict(suite=str(suite), out=out, dry_run=False, overrides=[], variants=None, no_resume=False,
                force=False, max_runs=None, time_budget=None, amend_seeds=False, shard=None)
    return argparse.Namespace(**{**base, **kw})


def rows(out: Path) -> dict[str, str]:
    with ResultStore(out / DB_NAME, create=False) as store:
        return {r.run_id: r.status for r in store.runs()}


def tree_hash(root: Path) -> dict[str, str]:
    """Every file under ``root`` (names and bytes): a merge must leave its source as it was."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_parse_shard_and_bad_values() -> None:
    assert parse_shard("0/2") == (0, 2) and parse_shard("2/3") == (2, 3)
    for bad in ("2/2", "x", "1", "-1/2", "0/0", "a/b", "1/2/3"):
        with pytest.raises(ConfigError, match="--shard"):
            parse_shard(bad)


def test_main_reports_a_bad_shard_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suite_file = write_suite(tmp_path)
    assert main(["compare", str(suite_file), "--out", str(tmp_path / "o"), "--shard", "2/2"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--shard 2/2" in err
    assert not (tmp_path / "o").exists()  # refused before anything was created


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 9])
def test_shards_partition_the_plan_and_spread_every_label(tmp_path: Path, count: int) -> None:
    plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "o", costs_fn=fake_costs)
    shards = [shard_ids(plan, i, count) for i in range(count)]
    assert sum(len(s) for s in shards) == len(plan.runs) == 7  # disjoint ...
    assert set().union(*shards) == {r.run_id for r in plan.runs}  # ... and covering
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    for label in plan.labels:  # each label's runs spread: every shard gets its share, rounded
        n = sum(r.label == label for r in plan.runs)
        per = [sum(r.label == label and r.run_id in s for r in plan.runs) for s in shards]
        assert max(per) - min(per) <= 1 and sum(per) == n
    # A function of the plan: the same on another machine, whatever its directory.
    other = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "elsewhere", costs_fn=fake_costs)
    assert [shard_ids(other, i, count) for i in range(count)] == shards


def _two_shards(tmp_path: Path) -> tuple[Path, Path, Path, list[set[str]]]:
    suite_file = write_suite(tmp_path)
    a, b = tmp_path / "machine-a" / "s", tmp_path / "machine-b" / "s"
    trained: list[set[str]] = []
    for i, out in enumerate((a, b)):
        trainer, console = FakeTrainer(), recording()
        assert run_compare(args(suite_file, out, shard=f"{i}/2"), train_fn=trainer, costs_fn=fake_costs,
                           console=console) == 0
        trained.append({name for name, _ in trainer.calls})
        assert set(rows(out)) == trained[-1]  # the other shard's runs are not even started here
        assert f"{7 - len(trained[-1])} runs left to the other shards" in console.export_text()
    return suite_file, a, b, trained


def test_two_shards_then_merge_give_the_whole_suite_once(tmp_path: Path) -> None:
    suite_file, a, b, trained = _two_shards(tmp_path)
    plan = build_plan(load_suite(suite_file), a, costs_fn=fake_costs)
    assert not trained[0] & trained[1] and trained[0] | trained[1] == {r.run_id for r in plan.runs}

    before = tree_hash(b)
    console = recording()
    assert run_merge(argparse.Namespace(dir=a, others=[b]), console=console) == 0
    assert tree_hash(b) == before  # the source directory is untouched, byte for byte
    assert "3 runs merged, 0 already here" in console.export_text()
    assert rows(a) == {r.run_id: "finished" for r in plan.runs}
    with sqlite3.connect(a / DB_NAME) as conn:  # one row per run, every column carried over
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 7
        ours = conn.execute("SELECT * FROM runs WHERE run_id IN (%s) ORDER BY run_id"
                            % ",".join("?" * len(trained[1])), sorted(trained[1])).fetchall()
    with sqlite3.connect(f"file:{b / DB_NAME}?mode=ro", uri=True) as conn:
        theirs = conn.execute("SELECT * FROM runs ORDER BY run_id").fetchall()
    assert ours == theirs
    for run_id in trained[1]:
        assert (a / RUNS_DIR / run_id / "ckpt").is_dir()
    assert not [p for p in (a / RUNS_DIR).iterdir() if p.name.startswith(".merge-")]
    md, _ = write_report(a)
    assert md.is_file()

    # The merged directory is complete: compare trains nothing; a second merge changes nothing.
    again = FakeTrainer()
    assert run_compare(args(suite_file, a), train_fn=again, costs_fn=fake_costs, console=quiet()) == 0
    assert again.calls == []
    snapshot = tree_hash(a / RUNS_DIR), rows(a)
    console = recording()
    assert run_merge(argparse.Namespace(dir=a, others=[b]), console=console) == 0
    assert "0 runs merged, 3 already here" in console.export_text()
    assert (tree_hash(a / RUNS_DIR), rows(a)) == snapshot


def worse(cfg: RunConfig, out_dir: Path, **kw: Any) -> Any:
    """The fake trainer with every evaluation 0.5 nats worse: the same run, another result."""
    result = FakeTrainer()(cfg, out_dir, **kw)
    return dataclasses.replace(result, val_curve=[{**p, "loss": p["loss"] + 0.5} for p in result.val_curve],
                               final_val_loss=result.final_val_loss + 0.5)


def test_merge_replaces_an_interrupted_run_and_keeps_ours_on_a_conflict(tmp_path: Path) -> None:
    suite_file, a, b, trained = _two_shards(tmp_path)
    plan = build_plan(load_suite(suite_file), a, costs_fn=fake_costs)
    theirs = sorted(trained[1])
    # Here: one of B's runs interrupted half-way, another finished with a different result.
    with ResultStore(a / DB_NAME) as store:
        run_suite(plan, store, [r for r in plan.runs if r.run_id == theirs[0]], train_fn=FakeTrainer(),
                  console=quiet(), stop_after_steps=10)
        other = next(r for r in plan.runs if r.run_id == theirs[1])
        run_suite(plan, store, [other], train_fn=worse, console=quiet())
    assert rows(a)[theirs[0]] == "running"
    console = recording()
    assert run_merge(argparse.Namespace(dir=a, others=[b]), console=console) == 1
    text = console.export_text()
    assert f"{theirs[1]}: finished in both with different results" in text
    with ResultStore(a / DB_NAME, create=False) as here, ResultStore(b / DB_NAME, create=False) as there:
        assert here.get(theirs[0]).status == "finished"
        assert here.get(theirs[0]).final_val_loss == there.get(theirs[0]).final_val_loss
        assert here.get(theirs[1]).final_val_loss != there.get(theirs[1]).final_val_loss  # ours kept


def test_merging_another_suite_or_config_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suite_file, a, b, _ = _two_shards(tmp_path)
    renamed = write_suite(tmp_path, SUITE_YAML.replace("name: fake", "name: other"), name="other.yaml")
    c = tmp_path / "machine-c" / "s"
    assert run_compare(args(renamed, c, shard="0/2"), train_fn=FakeTrainer(), costs_fn=fake_costs,
                       console=quiet()) == 0
    before, ours = tree_hash(c), rows(a)
    assert main(["merge", str(a), str(c)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "suite 'other'" in err and "nothing merged" in err
    # The same suite name under another budget: its run ids are not in this plan.
    d = tmp_path / "machine-d" / "s"
    assert run_compare(args(suite_file, d, shard="1/2", overrides=["train.warmup_steps=3"]),
                       train_fn=FakeTrainer(), costs_fn=fake_costs, console=quiet()) == 0
    with pytest.raises(ArchlabError, match="is not in .* plan: trained under another config"):
        run_merge(argparse.Namespace(dir=a, others=[d]), console=quiet())
    assert tree_hash(c) == before and rows(a) == ours


def test_a_shard_with_max_runs_starts_only_its_own_runs(tmp_path: Path) -> None:
    suite_file = write_suite(tmp_path)
    out = tmp_path / "o"
    plan = build_plan(load_suite(suite_file), out, costs_fn=fake_costs)
    mine = shard_ids(plan, 1, 3)
    first = FakeTrainer()
    assert run_compare(args(suite_file, out, shard="1/3", max_runs=1), train_fn=first, costs_fn=fake_costs,
                       console=quiet()) == 0
    rest = FakeTrainer()
    assert run_compare(args(suite_file, out, shard="1/3"), train_fn=rest, costs_fn=fake_costs,
                       console=quiet()) == 0
    assert len(first.calls) == 1 and {n for n, _ in first.calls + rest.calls} == mine
    assert rows(out) == {run_id: "finished" for run_id in mine}


def test_merging_a_directory_without_results_is_one_line_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.mkdir()
    for args in ([str(empty), str(missing)], [str(missing), str(empty)]):
        assert main(["merge", *args]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not a suite directory" in err[0]
    assert list(empty.iterdir()) == [] and not missing.exists()  # no lock file left behind
