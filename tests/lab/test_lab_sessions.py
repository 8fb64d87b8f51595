"""A suite spread over bounded calls (--max-runs, --time-budget), resumed from a copy of its
directory elsewhere, and the stop rule on seeds (archlab.lab.stoprule)."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from archlab.errors import ConfigError
from archlab.lab.cli import run_compare
from archlab.lab.display import RUNS_DIR
from archlab.lab.plan import build_plan
from archlab.lab.report import collect, write_report
from archlab.lab.runner import run_suite
from archlab.lab.session import Session
from archlab.lab.stoprule import INVALID
from archlab.lab.store import DB_NAME, ResultStore
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import SUITE_YAML, FakePrepare, FakeTrainer, fake_costs, write_suite

# The fake suite with a suite-managed corpus (its path lies inside the suite directory) and a
# paired design: every variant has the baseline's seeds, data order following the init seed.
MANAGED = (SUITE_YAML.replace("  data: {path: /nonexistent-data}\n", "")
           .replace("budget:", "data: {source: stdlib, max_mb: 1}\nbudget:")
           .replace("seeds: {baseline: [0, 1, 2], variants: [0, 1]}",
                    "seeds: {baseline: [0, 1, 2], variants: baseline, data: init}"))


def quiet() -> Console:
    return Console(file=open(os.devnull, "w"), width=200)


def args(suite: Path, out: Path, **kw: object) -> argparse.Namespace:
    base = dict(suite=str(suite), out=out, dry_run=False, overrides=[], variants=None, no_resume=False,
                force=False, max_runs=None, time_budget=None, amend_seeds=False)
    return argparse.Namespace(**{**base, **kw})


def finished(db: Path) -> set[str]:
    with ResultStore(db, create=False) as store:
        return {r.run_id for r in store.runs() if r.status == "finished"}


def test_a_suite_spread_over_calls_resumes_from_a_copy_elsewhere(tmp_path: Path, monkeypatch) -> None:
    import archlab.lab.runner as runner

    monkeypatch.setattr(runner, "_real_prepare", lambda: FakePrepare())
    suite_file = write_suite(tmp_path, MANAGED)
    here, there = tmp_path / "machine-a" / "suite", tmp_path / "machine-b" / "elsewhere"
    total = len(build_plan(load_suite(suite_file), here, costs_fn=fake_costs).runs)
    assert total == 9

    # Call 1 on machine A: three runs, then the line that says how many remain.
    first = FakeTrainer()
    console = Console(record=True, width=300, file=open(os.devnull, "w"))
    assert run_compare(args(suite_file, here, max_runs=3), train_fn=first, costs_fn=fake_costs,
                       console=console) == 0
    assert len(first.calls) == 3 and len(finished(here / DB_NAME)) == 3
    assert "6 runs left for another call (--max-runs 3 reached)" in console.export_text()

    # Interrupt a fourth run half-way (a call that ran out of time), then carry the directory away.
    plan_a = build_plan(load_suite(suite_file), here, costs_fn=fake_costs)
    with ResultStore(here / DB_NAME) as store:
        run_suite(plan_a, store, list(plan_a.runs[:4]), train_fn=FakeTrainer(), console=quiet(),
                  stop_after_steps=10)
    shutil.copytree(here, there)
    shutil.rmtree(here)  # machine A is gone

    # Call 2 on machine B, on the copy: nothing finished is trained again; the interrupted run
    # continues from its checkpoint; every run id is the same as on machine A.
    plan_b = build_plan(load_suite(suite_file), there, costs_fn=fake_costs)
    assert [r.run_id for r in plan_b.runs] == [r.run_id for r in plan_a.runs]
    done_before = finished(there / DB_NAME)
    second = FakeTrainer()
    assert run_compare(args(suite_file, there), train_fn=second, costs_fn=fake_costs, console=quiet()) == 0
    trained = {name for name, _ in second.calls}
    assert not trained & done_before and len(trained) == total - 3
    assert (plan_a.runs[3].run_id, 10) in second.calls  # resumed at its checkpoint, not from 0
    assert len(finished(there / DB_NAME)) == total
    with ResultStore(there / DB_NAME, create=False) as store:
        data = collect(store)
    # A paired design: every variant is decided by the paired test; the report has its compute.
    assert all(s.comparison is not None and s.comparison.method == "paired" for s in data.summaries[1:])
    md, _ = write_report(there)
    text = md.read_text()
    assert "## Compute" in text and "GPU-hours" in text and "paired with the baseline by seed" in text


def test_time_budget_starts_only_runs_that_fit(tmp_path: Path) -> None:
    # estimate.tokens_per_s: 81920 tokens at 8192 tok/s = 10 s per run (no run has finished yet).
    text = SUITE_YAML + "estimate: {tokens_per_s: 8192}\n"
    plan = build_plan(load_suite(write_suite(tmp_path, text)), tmp_path / "o", costs_fn=fake_costs)
    session = Session(seconds=25)
    trainer = FakeTrainer()
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs), train_fn=trainer, console=quiet(), session=session)
    # The fake trains in milliseconds, but its tokens/s is then measured: a later run's estimate
    # comes from the finished ones. With the suite's estimate alone, 2 runs of 10 s fit in 25 s.
    assert session.begun == len(trainer.calls) >= 2
    assert session.held_back or session.begun == len(plan.runs)
    # A budget below one run's expected time starts nothing, and says why.
    small = Session(seconds=5)
    plan2 = build_plan(load_suite(write_suite(tmp_path, text)), tmp_path / "o2", costs_fn=fake_costs)
    with ResultStore(plan2.out_dir / DB_NAME) as store:
        out = run_suite(plan2, store, list(plan2.runs), train_fn=FakeTrainer(), console=quiet(), session=small)
    assert out.finished == 0 and len(small.held_back) == len(plan2.runs)
    assert "more than the whole --time-budget" in (small.summary() or "")


def test_time_budget_uses_the_estimate() -> None:
    """The admission rule itself, on a fixed clock: elapsed + expected <= budget."""
    import archlab.lab.session as session_mod

    class _Plan:  # what expected_seconds reads is stubbed below
        pass

    s = Session(seconds=100)
    s.started = 0.0
    clock = iter([30.0, 65.0])
    orig_mono, orig_exp = session_mod.time.monotonic, session_mod.expected_seconds
    try:
        session_mod.time.monotonic = lambda: next(clock)  # type: ignore[assignment]
        session_mod.expected_seconds = lambda plan, rows, run: 40.0  # type: ignore[assignment]

        class _Run:
            label, init_seed, run_id = "llama", 0, "r1"

        assert s.admit(_Plan(), {}, _Run())  # 30 + 40 <= 100
        assert not s.admit(_Plan(), {}, _Run())  # 65 + 40 > 100
        assert s.summary().startswith("1 run left for another call (the next run needs about 0m40s")
    finally:
        session_mod.time.monotonic = orig_mono  # type: ignore[assignment]
        session_mod.expected_seconds = orig_exp


# ---- stop rule -------------------------------------------------------------------------------
def test_seeds_added_after_results_are_refused_or_void_the_verdicts(tmp_path: Path) -> None:
    suite_file = write_suite(tmp_path, SUITE_YAML)
    out = tmp_path / "o"
    assert run_compare(args(suite_file, out, max_runs=2), train_fn=FakeTrainer(), costs_fn=fake_costs,
                       console=quiet()) == 0
    more = write_suite(tmp_path, SUITE_YAML.replace("variants: [0, 1]}", "variants: [0, 1, 2]}"))
    with pytest.raises(ConfigError, match=r"seeds: changed after 2 run\(s\) finished \(lower-init adds "
                                          r"init 2/data 0; same adds init 2/data 0\)"):
        run_compare(args(more, out), train_fn=FakeTrainer(), costs_fn=fake_costs, console=quiet())
    assert len(finished(out / DB_NAME)) == 2  # refused before anything trained
    # Forced: it runs, and the report shows the tests but no verdict.
    assert run_compare(args(more, out, amend_seeds=True), train_fn=FakeTrainer(), costs_fn=fake_costs,
                       console=quiet()) == 0
    with ResultStore(out / DB_NAME, create=False) as store:
        data = collect(store)
    assert all(s.comparison.verdict == INVALID for s in data.summaries[1:])
    assert all(s.comparison.p is not None for s in data.summaries[1:])
    md, _ = write_report(out)
    assert "Stop rule broken: lower-init adds init 2/data 0" in md.read_text()


def test_seed_changes_before_any_result_and_new_variants_are_fine(tmp_path: Path) -> None:
    out = tmp_path / "o"
    first = write_suite(tmp_path, SUITE_YAML, name="a.yaml")
    plan = build_plan(load_suite(first), out, costs_fn=fake_costs)
    with ResultStore(out / DB_NAME) as store:
        run_suite(plan, store, [], train_fn=FakeTrainer(), console=quiet())  # registers, trains nothing
    changed = write_suite(tmp_path, SUITE_YAML.replace("variants: [0, 1]}", "variants: [0, 1, 2]}"), name="b.yaml")
    console = Console(record=True, width=300, file=open(os.devnull, "w"))
    plan = build_plan(load_suite(changed), out, costs_fn=fake_costs)
    with ResultStore(out / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs[:2]), train_fn=FakeTrainer(), console=console)
    assert "seed plan changed before any result" in console.export_text()
    # A new variant after results is not a change of anyone's seeds.
    grown = write_suite(tmp_path, SUITE_YAML.replace("variants: [0, 1]}", "variants: [0, 1, 2]}")
                        .replace("  same: {model.rope_theta: 5000.0}\n",
                                 "  same: {model.rope_theta: 5000.0}\n  third: {model.init_std: 0.03}\n"),
                        name="c.yaml")
    plan = build_plan(load_suite(grown), out, costs_fn=fake_costs)
    with ResultStore(out / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs[:3]), train_fn=FakeTrainer(), console=quiet())
        data = collect(store)
    assert not data.seed_changes
