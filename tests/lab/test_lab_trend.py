"""archlab trend: a variant's effect in suites of two sizes and the test of its change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.stats as sps
from rich.console import Console

from archlab.errors import ArchlabError
from archlab.lab.plan import build_plan
from archlab.lab.runner import run_suite
from archlab.lab.store import DB_NAME, ResultStore
from archlab.lab.suite import load_suite
from archlab.lab.report.trend import load_suite_dir, markdown, trend
from tests.lab.lab_fakes import SUITE_YAML, FakeTrainer, fake_costs, write_suite


def _finished_suite(tmp: Path, name: str, lr: str) -> Path:
    """A fake suite, every variant paired with the baseline by seed; ``lr`` makes the sizes differ."""
    text = (SUITE_YAML.replace("name: fake", f"name: {name}")
            .replace("variants: [0, 1]}", "variants: baseline}")
            .replace("ckpt_every: 10,", f"ckpt_every: 10, lr: {lr},"))
    plan = build_plan(load_suite(write_suite(tmp, text, f"{name}.yaml")), tmp / name, costs_fn=fake_costs)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=Console(file=open(os.devnull, "w")))
    return plan.out_dir


@pytest.fixture(scope="module")
def two_sizes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("trend")
    return _finished_suite(tmp, "small", "0.003"), _finished_suite(tmp, "large", "0.001")


def _diffs(path: Path, label: str) -> np.ndarray:
    with ResultStore(path / DB_NAME) as store:
        rows = [r for r in store.runs() if r.status == "finished"]
    base = {(r.init_seed, r.data_seed): r.final_val_loss for r in rows if r.label == "llama"}
    return np.array([r.final_val_loss - base[(r.init_seed, r.data_seed)] for r in rows if r.label == label])


def test_effects_and_their_change_against_a_hand_computation(two_sizes: tuple[Path, Path]) -> None:
    small, large = two_sizes
    rows = trend([*load_suite_dir(small), *load_suite_dir(large)])
    assert [r.label for r in rows] == ["lower-init", "same"]
    welch = []
    for r in rows:
        a, b = _diffs(small, r.label), _diffs(large, r.label)
        assert len(a) == len(b) == 3  # paired: one difference per seed
        assert [p.suite for p in r.points] == ["small", "large"]
        assert r.points[0].effect == pytest.approx(a.mean(), abs=1e-12)
        assert r.points[1].effect == pytest.approx(b.mean(), abs=1e-12)
        assert r.change == pytest.approx(b.mean() - a.mean(), abs=1e-12)
        assert r.p == pytest.approx(sps.ttest_ind(b, a, equal_var=False).pvalue, rel=1e-9)
        welch.append(r.p)
    low, high = sorted(welch)  # Holm over the two shared labels
    holm = {low: min(1.0, 2 * low), high: max(min(1.0, 2 * low), high)}
    assert [r.p_holm for r in rows] == pytest.approx([holm[p] for p in welch])
    for r in rows:  # the trend's verdict follows from Holm's p and the two effects
        first, last = r.points
        expect = ("holds (no significant change)" if r.p_holm >= 0.05 else "reverses"
                  if first.effect * last.effect < 0 and last.verdict in ("better", "worse")
                  else "shrinks" if abs(last.effect) < abs(first.effect) else "grows")
        assert r.verdict == expect
    table = markdown(rows)
    assert table.splitlines()[0].startswith("| variant | Δ small (adj. p, verdict) | Δ large")
    assert len(table.splitlines()) == 2 + len(rows)


def test_trend_errors_are_one_line(two_sizes: tuple[Path, Path], tmp_path: Path) -> None:
    small, _ = two_sizes
    with pytest.raises(ArchlabError, match="at least two"):
        trend(load_suite_dir(small))
    with pytest.raises(ArchlabError, match="is not a suite directory"):
        load_suite_dir(tmp_path)
    cli = [sys.executable, "-m", "archlab.cli", "trend"]
    one = subprocess.run([*cli, str(small)], capture_output=True, text=True)
    assert one.returncode == 2 and one.stderr.count("\n") == 1 and "at least two" in one.stderr
    missing = subprocess.run([*cli, str(small), str(tmp_path)], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "not a suite directory" in missing.stderr
    ok = subprocess.run([*cli, *map(str, two_sizes), "--md"], capture_output=True, text=True)
    assert ok.returncode == 0 and "| lower-init |" in ok.stdout


# ---- several token budgets in one suite -------------------------------------------------------
MULTI = (SUITE_YAML.replace("tokens: 81920", "tokens: [40960, 80k, 122880]")  # 20, 39 and 60 steps
         .replace("variants: [0, 1]}", "variants: baseline}")
         .replace("warmup_steps: 2, eval_every: 5", "eval_every: 5"))


def test_a_multi_budget_suite_plans_independent_runs_with_their_own_schedules(tmp_path: Path) -> None:
    plan = build_plan(load_suite(write_suite(tmp_path, MULTI)), tmp_path / "o", costs_fn=fake_costs)
    assert plan.suite.budget.tokens == (40960, 80000, 122880)
    assert len(plan.runs) == 3 * 3 * 3 and len({r.run_id for r in plan.runs}) == 27
    by_budget = {b: [r for r in plan.runs if r.budget == b] for b in plan.suite.budget.tokens}
    for budget, runs in by_budget.items():
        steps = round(budget / 2048)
        assert {r.steps for r in runs} == {steps} and {r.tokens for r in runs} == {steps * 2048}
        # a schedule of its own length: warm-up 5% of its own steps, not a cut of the longest run's
        assert {r.config.train.warmup for r in runs} == {round(0.05 * steps)}
        assert {(r.label, r.init_seed) for r in runs} == {(lbl, s) for lbl in ("llama", "lower-init", "same")
                                                          for s in (0, 1, 2)}
    assert [r.config.train.warmup for r in (by_budget[40960][0], by_budget[122880][0])] == [1, 3]
    assert plan.runs[0].budget == 40960  # the shortest budget trains first
    assert "llama-41k-s0-d0-" in plan.runs[0].run_id and plan.meta()["runs"][0]["budget"] == 40960


def test_trend_across_the_budgets_of_one_suite_against_a_hand_computation(tmp_path: Path) -> None:
    plan = build_plan(load_suite(write_suite(tmp_path, MULTI)), tmp_path / "o", costs_fn=fake_costs)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=Console(file=open(os.devnull, "w")))
        rows_db = [r for r in store.runs() if r.status == "finished"]
    points = load_suite_dir(plan.out_dir)
    assert [p.budget for p in points] == [40960, 80000, 122880]
    assert [p.name for p in points] == ["fake @41k tokens", "fake @80k tokens", "fake @123k tokens"]
    rows = trend(points)
    budget_of = {r.run_id: r.budget for r in plan.runs}

    def diffs(label: str, budget: int) -> np.ndarray:
        mine = [r for r in rows_db if budget_of[r.run_id] == budget]
        base = {(r.init_seed, r.data_seed): r.final_val_loss for r in mine if r.label == "llama"}
        return np.array([r.final_val_loss - base[(r.init_seed, r.data_seed)] for r in mine if r.label == label])

    welch = []
    for r in rows:
        first, last = diffs(r.label, 40960), diffs(r.label, 122880)
        assert [p.tokens for p in r.points] == [40960, 80000, 122880]
        assert [p.effect for p in r.points] == pytest.approx(
            [diffs(r.label, b).mean() for b in (40960, 80000, 122880)], abs=1e-12)
        assert r.change == pytest.approx(last.mean() - first.mean(), abs=1e-12)
        assert r.p == pytest.approx(sps.ttest_ind(last, first, equal_var=False).pvalue, rel=1e-9)
        welch.append(r.p)
    low, high = sorted(welch)
    holm = {low: min(1.0, 2 * low), high: max(min(1.0, 2 * low), high)}
    assert [r.p_holm for r in rows] == pytest.approx([holm[p] for p in welch])
    # the report: a section per budget, the effects against length and their figure
    from archlab.lab.report import write_report

    md = write_report(plan.out_dir)[0].read_text()
    assert all(f"## Budget {b} tokens" in md for b in ("41k", "80k", "123k"))
    assert "## Effect against training length" in md and "effect_by_length.png" in md
    assert (plan.out_dir / "effect_by_length.png").stat().st_size > 0
    cli = subprocess.run([sys.executable, "-m", "archlab.cli", "trend", str(plan.out_dir), "--md"],
                         capture_output=True, text=True)
    assert cli.returncode == 0 and "| lower-init |" in cli.stdout and "fake @123k tokens" in cli.stdout


def test_the_same_suite_directory_twice_is_refused(two_sizes: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    """Its points against themselves would show a change of exactly zero, which reads as a result."""
    from tests.helpers import run_cli

    small, large = two_sizes
    link = tmp_path / "again"
    link.symlink_to(small)
    for dirs in ([small, small], [small, large, link]):
        code, out, err = run_cli(capsys, "trend", *map(str, dirs))
        assert code == 2 and out == "" and err.count("\n") == 1, (code, out, err)
        assert f"{dirs[-1]} is given twice" in err and "different suite directories" in err


def test_a_budget_not_trained_yet_leaves_the_trend_over_the_budgets_measured(tmp_path: Path) -> None:
    """A multi-budget suite whose longest budget has no run yet: the change runs from the first
    budget to the last one measured (named in the change cell), against a hand computation."""
    plan = build_plan(load_suite(write_suite(tmp_path, MULTI)), tmp_path / "o", costs_fn=fake_costs)
    budget_of = {r.run_id: r.budget for r in plan.runs}
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, [r for r in plan.runs if r.budget < 122880], train_fn=FakeTrainer(),
                  console=Console(file=open(os.devnull, "w")))
        rows_db = [r for r in store.runs() if r.status == "finished"]
    rows = trend(load_suite_dir(plan.out_dir))

    def diffs(label: str, budget: int) -> np.ndarray:
        mine = [r for r in rows_db if budget_of[r.run_id] == budget]
        base = {(r.init_seed, r.data_seed): r.final_val_loss for r in mine if r.label == "llama"}
        return np.array([r.final_val_loss - base[(r.init_seed, r.data_seed)] for r in mine if r.label == label])

    for r in rows:
        first, last = diffs(r.label, 40960), diffs(r.label, 80000)
        assert r.points[-1].effect is None
        assert r.change == pytest.approx(last.mean() - first.mean(), abs=1e-12)
        assert r.p == pytest.approx(sps.ttest_ind(last, first, equal_var=False).pvalue, rel=1e-9)
        assert r.verdict != "-" and r.change_cell().endswith("(41k->80k)")
    assert "(41k->80k)" in markdown(rows)
