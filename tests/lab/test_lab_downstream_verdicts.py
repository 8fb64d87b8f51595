"""Downstream verdicts (issue 32): one per task family, paired on shared seeds, Holm over
variants x families, against a hand computation with scipy; no verdict where the baseline is at
chance."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.stats as sps

from archlab.config import RunConfig
from archlab.eval.tasks import MCItem, chance_level
from archlab.lab.report import collect, downstream_verdicts_table, results_table, write_report
from archlab.lab.report.downstream import AT_CHANCE, families_for
from archlab.lab.runner import run_suite
from archlab.lab.store import DB_NAME, ResultStore
from tests.lab.lab_fakes import DOWNSTREAM_EVAL, SUITE_YAML, FakeTrainer
from tests.lab.test_lab_downstream import plan_for, quiet

# paired seeds: every variant has the baseline's three (init, data) pairs
SUITE = SUITE_YAML.replace("eval: {last_k: 1}\n", DOWNSTREAM_EVAL).replace("variants: [0, 1]}", "variants: baseline}")
LIFT = {0.02: 0.0, 0.01: 0.08}  # lambada accuracy added by init_std (lower-init: +0.08; same: 0)


def score(cfg: RunConfig, task: str) -> float:
    """piqa: at its chance level (1/3, three choices) give or take noise; lambada: 0.5 + lift."""
    rng = random.Random(f"{cfg.train.seed}/{cfg.model.init_std}/{cfg.model.rope_theta}/{task}")
    if task == "piqa":
        return 1 / 3 + rng.gauss(0.0, 0.01)
    return 0.5 + LIFT[cfg.model.init_std] + rng.gauss(0.0, 0.01)


def fake_eval(run_dir: Path, cfg: RunConfig, tasks: dict[str, list[Any]], *, progress: Any = None) -> dict:
    out = {}
    for name, items in tasks.items():
        value, n = score(cfg, name), len(items)
        se = math.sqrt(value * (1 - value) / n)
        out[name] = ({"acc": value, "acc_stderr": se, "acc_norm": value, "acc_norm_stderr": se, "n": n}
                     if name == "piqa" else {"acc": value, "acc_stderr": se, "n": n, "ppl": 10.0})
    return out


def test_chance_level_of_items() -> None:
    items = [MCItem("a", (" b", " c"), 0), MCItem("a", (" b", " c", " d", " e"), 1)]
    assert chance_level(items) == pytest.approx((1 / 2 + 1 / 4) / 2)
    assert chance_level([]) == 0.0
    assert families_for(["piqa", "lambada", "twohop_id"]) == {
        "commonsense": ("piqa",), "lambada": ("lambada",), "twohop_id": ("twohop_id",)}
    assert families_for(["piqa", "lambada"], {"all": ["piqa", "lambada"]}) == {"all": ("piqa", "lambada")}


def test_downstream_verdicts_against_a_hand_computation(tmp_path: Path) -> None:
    plan = plan_for(tmp_path, SUITE)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=quiet(), eval_fn=fake_eval)
        data = collect(store)
        rows = {r.run_id: r for r in store.runs()}
        stored = store.downstream()
    piqa_chance = chance_level([it for it in _piqa_items(tmp_path)])
    assert piqa_chance == pytest.approx(1 / 3)
    assert [d.chance for d in stored if d.task == "piqa"] == pytest.approx([piqa_chance] * 9)
    assert {d.chance for d in stored if d.task == "lambada"} == {0.0}

    dv = data.downstream_verdicts
    assert [f.family for f in dv.families] == ["commonsense", "lambada"] and dv.n_tests == 2 * 2

    def per_seed(label: str, task: str) -> dict[tuple[int, int], float]:
        return {(rows[d.run_id].init_seed, rows[d.run_id].data_seed): d.value for d in stored
                if d.task == task and rows[d.run_id].label == label}

    # by hand: paired t-tests on the 3 seed pairs, then Holm over the 4 (variant, family) p-values
    ps, diffs = {}, {}
    for fam, task in (("commonsense", "piqa"), ("lambada", "lambada")):
        base = per_seed("llama", task)
        for label in ("lower-init", "same"):
            mine = per_seed(label, task)
            keys = sorted(base)
            ps[(fam, label)] = sps.ttest_rel([mine[k] for k in keys], [base[k] for k in keys]).pvalue
            diffs[(fam, label)] = np.mean([mine[k] for k in keys]) - np.mean([base[k] for k in keys])
    order = sorted(ps, key=ps.get)
    holm, running = {}, 0.0
    for j, key in enumerate(order):
        running = max(running, min(1.0, (4 - j) * ps[key]))
        holm[key] = running
    for f in dv.families:
        for label, c in f.comparisons.items():
            assert c is not None and c.method == "paired" and c.n_pairs == 3
            assert c.p == pytest.approx(ps[(f.family, label)], rel=1e-9)
            assert c.p_holm == pytest.approx(holm[(f.family, label)], rel=1e-9)
            assert c.diff == pytest.approx(diffs[(f.family, label)], abs=1e-12)  # positive is better
    commonsense, lambada = dv.families
    # piqa's baseline sits at chance (within twice its error): no verdict drawn on that family
    assert commonsense.at_chance and commonsense.chance == pytest.approx(1 / 3)
    assert {c.verdict for c in commonsense.comparisons.values()} == {AT_CHANCE}
    assert not lambada.at_chance and lambada.chance == 0.0
    expect = "better" if holm[("lambada", "lower-init")] < 0.05 else "no significant difference"
    assert lambada.comparisons["lower-init"].verdict == expect == "better"  # +0.08, noise 0.01
    assert lambada.comparisons["same"].verdict == ("no significant difference" if holm[("lambada", "same")] >= 0.05
                                                   else "better" if diffs[("lambada", "same")] > 0 else "worse")

    header, table = results_table(data)
    assert header[header.index("verdict") + 1:][:2] == ["commonsense verdict", "lambada verdict"]
    assert table[1][header.index("lambada verdict")] == f"{lambada.comparisons['lower-init'].diff:+.4f} (better)"
    assert table[1][header.index("commonsense verdict")].endswith(f"({AT_CHANCE})")
    d_header, d_rows = downstream_verdicts_table(data)
    assert d_header[1].startswith("commonsense (piqa; chance 0.333; baseline ")
    md = write_report(plan.out_dir)[0].read_text()
    assert "## Downstream verdicts" in md and "no downstream verdict is drawn on it" in md


def _piqa_items(tmp: Path) -> list:
    from archlab.eval.tasks import load_task

    return load_task("piqa", tmp / "tasks" / "piqa.jsonl", 5)
