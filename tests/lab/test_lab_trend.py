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
    rows = trend([load_suite_dir(small), load_suite_dir(large)])
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
    table = markdown(rows)
    assert table.splitlines()[0].startswith("| variant | Δ small (adj. p, verdict) | Δ large")
    assert len(table.splitlines()) == 2 + len(rows)


def test_trend_errors_are_one_line(two_sizes: tuple[Path, Path], tmp_path: Path) -> None:
    small, _ = two_sizes
    with pytest.raises(ArchlabError, match="at least two"):
        trend([load_suite_dir(small)])
    with pytest.raises(ArchlabError, match="is not a suite directory"):
        load_suite_dir(tmp_path)
    cli = [sys.executable, "-m", "archlab.cli", "trend"]
    one = subprocess.run([*cli, str(small)], capture_output=True, text=True)
    assert one.returncode == 2 and one.stderr.count("\n") == 1 and "at least two" in one.stderr
    missing = subprocess.run([*cli, str(small), str(tmp_path)], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "not a suite directory" in missing.stderr
    ok = subprocess.run([*cli, *map(str, two_sizes), "--md"], capture_output=True, text=True)
    assert ok.returncode == 0 and "| lower-init |" in ok.stdout
