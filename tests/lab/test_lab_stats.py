"""The lab's statistics against scipy.stats on fixed inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from archlab.lab.stats import compare, noise_floor

BASE = [3.1012, 3.0987, 3.1040, 3.1003]
BETTER = [3.0801, 3.0836, 3.0779]
SAME = [3.1020, 3.0979, 3.1031]


def test_noise_floor_is_sample_std() -> None:
    assert noise_floor(BASE) == pytest.approx(np.std(BASE, ddof=1), rel=1e-12)
    assert noise_floor([3.0]) is None


@pytest.mark.parametrize("variant", [BETTER, SAME, [3.2, 3.25]])
def test_welch_matches_scipy(variant: list[float]) -> None:
    ref = sps.ttest_ind(variant, BASE, equal_var=False)
    ci = ref.confidence_interval(0.95)
    c = compare(BASE, variant, n_tests=3)
    assert c.method == "welch"
    assert c.diff == pytest.approx(np.mean(variant) - np.mean(BASE), abs=1e-12)
    assert c.t == pytest.approx(ref.statistic, rel=1e-9)
    assert c.df == pytest.approx(ref.df, rel=1e-9)
    assert c.p == pytest.approx(ref.pvalue, rel=1e-9)
    assert (c.ci_low, c.ci_high) == (pytest.approx(ci.low, rel=1e-9), pytest.approx(ci.high, rel=1e-9))
    assert c.p_adjusted == pytest.approx(min(1.0, 3 * ref.pvalue), rel=1e-9)
    assert c.z == pytest.approx(c.diff / np.std(BASE, ddof=1), rel=1e-12)


def test_single_variant_seed_is_the_pooled_prediction_test() -> None:
    y = 3.0905
    ref = sps.ttest_ind([y], BASE, equal_var=True)
    ci = ref.confidence_interval(0.95)
    c = compare(BASE, [y], n_tests=2)
    assert c.method == "pooled (single seed)"
    assert c.df == pytest.approx(len(BASE) - 1)
    assert c.t == pytest.approx(ref.statistic, rel=1e-9)
    assert c.p == pytest.approx(ref.pvalue, rel=1e-9)
    assert (c.ci_low, c.ci_high) == (pytest.approx(ci.low, rel=1e-9), pytest.approx(ci.high, rel=1e-9))
    # The same as the prediction-interval test of one new observation against the sample.
    s, n = np.std(BASE, ddof=1), len(BASE)
    t = (y - np.mean(BASE)) / (s * math.sqrt(1 + 1 / n))
    assert c.t == pytest.approx(t, rel=1e-9)
    assert c.p == pytest.approx(2 * sps.t.sf(abs(t), n - 1), rel=1e-9)


def test_single_baseline_seed_uses_the_variant_spread() -> None:
    ref = sps.ttest_ind(BETTER, [3.1], equal_var=True)
    c = compare([3.1], BETTER, n_tests=1)
    assert c.method == "pooled (single seed)"
    assert c.p == pytest.approx(ref.pvalue, rel=1e-9)
    assert c.z is None  # no noise floor from one baseline seed


def test_bonferroni_verdicts() -> None:
    better = compare(BASE, BETTER, n_tests=3)
    assert better.p_adjusted < 0.05 and better.verdict == "better"
    worse = compare(BASE, [3.2, 3.25, 3.22], n_tests=3)
    assert worse.verdict == "worse"
    assert compare(BASE, SAME, n_tests=3).verdict == "no significant difference"
    # Significant alone, not after correcting for many variants.
    mid = [3.1046, 3.1075, 3.1061]
    alone = compare(BASE, mid, n_tests=1)
    assert alone.p < 0.05 and alone.verdict == "worse"
    many = compare(BASE, mid, n_tests=1000)
    assert many.p_adjusted == 1.0 or many.p_adjusted >= 0.05
    assert many.verdict == "no significant difference"


def test_degenerate_inputs() -> None:
    assert compare([3.0], [2.9], n_tests=1).verdict == "insufficient seeds"
    flat = compare([3.0, 3.0], [3.0, 3.0], n_tests=1)
    assert flat.verdict == "undetermined" and flat.p is None
    with pytest.raises(ValueError):
        compare([], [1.0], n_tests=1)
