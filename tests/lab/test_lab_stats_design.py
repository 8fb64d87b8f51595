"""The paired test, the minimum detectable effect and Holm's adjustment, against scipy, statsmodels
(where installed), simulation and hand-computed examples."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from archlab.lab.stats import (compare, decide_family, detectable_effect, holm, mde_paired, mde_unpaired,
                               paired_test, pairs)

BASE = [3.1012, 3.0987, 3.1040]
VAR = [3.0950, 3.0941, 3.0998]
KEYS = [(0, 0), (1, 1), (2, 2)]


def test_paired_test_matches_scipy_ttest_rel() -> None:
    ref = sps.ttest_rel(VAR, BASE)
    ci = ref.confidence_interval(0.95)
    t = paired_test(np.subtract(VAR, BASE))
    assert t is not None and t.method == "paired" and t.n == 3
    assert t.t == pytest.approx(ref.statistic, rel=1e-9)
    assert t.df == pytest.approx(ref.df)
    assert t.p == pytest.approx(ref.pvalue, rel=1e-9)
    assert (t.ci_low, t.ci_high) == (pytest.approx(ci.low, rel=1e-9), pytest.approx(ci.high, rel=1e-9))


def test_paired_test_by_hand() -> None:
    # d = -0.010, -0.020, -0.015: mean -0.015, sd 0.005, se 0.005/sqrt(3), t = -3 sqrt(3) = -5.196.
    # With 2 degrees of freedom P(|T| > t) = 1 - t / sqrt(2 + t^2) = 1 - 5.196 / sqrt(29) = 0.03508.
    t = paired_test([-0.010, -0.020, -0.015])
    assert t is not None
    assert t.t == pytest.approx(-3 * math.sqrt(3), rel=1e-9)
    assert t.df == 2
    assert t.p == pytest.approx(1 - 3 * math.sqrt(3) / math.sqrt(29), rel=1e-9)
    assert t.p == pytest.approx(0.03508, abs=5e-5)


def test_complete_pairing_decides_with_the_paired_test() -> None:
    c = compare(BASE, VAR, n_tests=2, baseline_keys=KEYS, variant_keys=list(reversed(KEYS))[::-1])
    assert c.method == "paired"
    ref = sps.ttest_rel(VAR, BASE)
    assert c.p == pytest.approx(ref.pvalue, rel=1e-9)
    assert c.p_adjusted == pytest.approx(min(1.0, 2 * ref.pvalue), rel=1e-9)
    # The unpaired test is reported next to it, and is Welch's.
    assert c.unpaired is not None and c.unpaired.p == pytest.approx(
        sps.ttest_ind(VAR, BASE, equal_var=False).pvalue, rel=1e-9)
    # Pairs are matched by key, not by position.
    shuffled = compare([BASE[2], BASE[0], BASE[1]], VAR, n_tests=2, baseline_keys=[KEYS[2], KEYS[0], KEYS[1]],
                       variant_keys=KEYS)
    assert shuffled.p == pytest.approx(c.p, rel=1e-12)


def test_every_shared_seed_pair_decides() -> None:
    """Issue 32: baseline seeds [0, 1, 2, 3] against variant seeds [0, 1, 2], data order = init
    seed: the paired test decides on the 3 shared pairs (scipy's ttest_rel on them, by hand too);
    the baseline's fourth seed is still in the noise floor and the unpaired test beside it."""
    base = [3.1012, 3.0987, 3.1040, 3.0975]
    var = [3.0950, 3.0941, 3.0998]
    keys = [(s, s) for s in range(4)]
    c = compare(base, var, n_tests=2, baseline_keys=keys, variant_keys=keys[:3])
    assert c.method == "paired" and c.n_pairs == 3 and c.paired is not None and c.paired.n == 3
    ref = sps.ttest_rel(var, base[:3])
    assert c.p == pytest.approx(ref.pvalue, rel=1e-9) and c.t == pytest.approx(ref.statistic, rel=1e-9)
    d = np.subtract(var, base[:3])
    t_hand = d.mean() / (d.std(ddof=1) / math.sqrt(3))
    assert c.t == pytest.approx(t_hand, rel=1e-12)
    assert c.p == pytest.approx(2 * sps.t.sf(abs(t_hand), 2), rel=1e-12)
    assert c.p_adjusted == pytest.approx(min(1.0, 2 * ref.pvalue), rel=1e-12)
    assert c.diff == pytest.approx(np.mean(var) - np.mean(base), rel=1e-12)  # the effect: all seeds
    assert c.z == pytest.approx(c.diff / np.std(base, ddof=1), rel=1e-12)  # the floor: all 4 seeds
    assert c.unpaired is not None and c.unpaired.p == pytest.approx(
        sps.ttest_ind(var, base, equal_var=False).pvalue, rel=1e-9)
    # One shared pair is no paired test: the unpaired test over every run decides.
    one = compare(base, var, n_tests=1, baseline_keys=keys, variant_keys=[(0, 0), (5, 5), (6, 6)])
    assert one.method == "welch" and one.n_pairs == 1
    # Different data seeds are different pairs: nothing pairs, the paired test is absent.
    other = compare(BASE, VAR, n_tests=1, baseline_keys=KEYS, variant_keys=[(0, 9), (1, 9), (2, 9)])
    assert other.method == "welch" and other.paired is None and other.n_pairs == 0
    # No keys: the old behaviour exactly.
    assert compare(BASE, VAR, n_tests=1).method == "welch"


def test_pairs_refuses_mismatched_keys() -> None:
    with pytest.raises(ValueError):
        pairs(BASE, VAR, KEYS[:2], KEYS)
    diffs, complete = pairs(BASE, VAR, [KEYS[0], KEYS[0], KEYS[1]], KEYS)
    assert not complete  # a repeated key is not a design


# ---- minimum detectable effect --------------------------------------------------------------
def _power(lam: float, df: float, alpha: float) -> float:
    crit = sps.t.ppf(1 - alpha / 2, df)
    return sps.nct.sf(crit, df, lam) + sps.nct.cdf(-crit, df, lam)


@pytest.mark.parametrize("df,alpha", [(2, 0.05), (4, 0.05 / 3), (10, 0.01), (60, 0.05)])
def test_detectable_effect_has_the_power_asked_for(df: int, alpha: float) -> None:
    mde = detectable_effect(1.0, df, alpha)
    assert _power(mde, df, alpha) == pytest.approx(0.8, abs=1e-9)
    # The textbook approximation (t_crit + t_power) * se is close, and closer with more df.
    approx = sps.t.ppf(1 - alpha / 2, df) + sps.t.ppf(0.8, df)
    assert mde == pytest.approx(approx, rel=0.06 if df < 5 else 0.02)
    assert detectable_effect(0.002, df, alpha) == pytest.approx(0.002 * mde, rel=1e-9)


def test_mde_by_hand_with_many_degrees_of_freedom() -> None:
    # As df grows the t test becomes the z test: MDE = (z_{0.975} + z_{0.8}) se = (1.95996 + 0.84162) se.
    assert detectable_effect(1.0, 1e6, 0.05) == pytest.approx(1.95996 + 0.84162, abs=2e-4)


def test_mde_by_simulation() -> None:
    """Data generated with the true difference = the MDE: the tests reject about 80% of the time."""
    rng = np.random.default_rng(0)
    sims, alpha = 40_000, 0.05 / 2
    # Paired, 4 pairs, sd of differences 0.003.
    mde = mde_paired(0.003, 4, alpha)
    d = rng.normal(mde, 0.003, size=(sims, 4))
    p = sps.ttest_1samp(d, 0.0, axis=1).pvalue
    assert np.mean(p < alpha) == pytest.approx(0.8, abs=0.01)
    # Unpaired, 3 baseline and 3 variant seeds, noise 0.002 on both sides, pooled t-test.
    mde = mde_unpaired(0.002, 3, 3, alpha)
    a = rng.normal(0.0, 0.002, size=(sims, 3))
    b = rng.normal(mde, 0.002, size=(sims, 3))
    p = sps.ttest_ind(b, a, axis=1, equal_var=True).pvalue
    assert np.mean(p < alpha) == pytest.approx(0.8, abs=0.01)


def test_mde_against_statsmodels() -> None:
    power = pytest.importorskip("statsmodels.stats.power")
    es = power.TTestPower().solve_power(effect_size=None, nobs=5, alpha=0.01, power=0.8)
    assert mde_paired(1.0, 5, 0.01) == pytest.approx(es, rel=1e-4)
    es = power.TTestIndPower().solve_power(effect_size=None, nobs1=3, ratio=2 / 3, alpha=0.05 / 4, power=0.8)
    assert mde_unpaired(1.0, 3, 2, 0.05 / 4) == pytest.approx(es, rel=1e-4)


def test_compare_reports_the_mde_of_the_deciding_test() -> None:
    c = compare(BASE, VAR[:2], n_tests=3, planned=(3, 2))
    floor = np.std(BASE, ddof=1)
    assert c.mde == pytest.approx(mde_unpaired(floor, 3, 2, 0.05 / 3), rel=1e-12)
    c = compare(BASE, VAR, n_tests=3, baseline_keys=KEYS, variant_keys=KEYS)
    sd = np.std(np.subtract(VAR, BASE), ddof=1)
    assert c.mde == pytest.approx(mde_paired(sd, 3, 0.05 / 3), rel=1e-12)


# ---- Holm ------------------------------------------------------------------------------------
def test_holm_by_hand() -> None:
    # sorted: 0.005 * 4 = 0.02; 0.01 * 3 = 0.03; 0.03 * 2 = 0.06; 0.04 * 1 = 0.04 -> max(0.06, 0.04)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.6, 0.5]) == pytest.approx([1.0, 1.0])  # capped at 1 (0.5 * 2 = 1.0)


def test_holm_with_pending_tests_is_conservative() -> None:
    # A family of 3 with one p unknown: it counts as the largest, so the known ones get the
    # multipliers 3 and 2, never smaller ones.
    assert holm([0.01, None, 0.02], m=3) == pytest.approx([0.03, None, 0.04])
    with pytest.raises(ValueError):
        holm([0.1, 0.2, 0.3], m=2)


def test_holm_against_statsmodels() -> None:
    multitest = pytest.importorskip("statsmodels.stats.multitest")
    rng = np.random.default_rng(1)
    for _ in range(200):
        ps = rng.uniform(0, 0.2, size=int(rng.integers(1, 9))) ** rng.uniform(1, 3)
        ref = multitest.multipletests(ps, method="holm")[1]
        assert holm(list(ps)) == pytest.approx(list(ref), rel=1e-12, abs=1e-15)
        bonf = multitest.multipletests(ps, method="bonferroni")[1]
        assert [min(1.0, p * len(ps)) for p in ps] == pytest.approx(list(bonf), rel=1e-12)


def test_decide_family_applies_the_chosen_adjustment() -> None:
    # Two variants; p = 0.004 and about 0.03: Bonferroni (x2) keeps only the first at 0.05, Holm
    # (x2, then x1) both.
    base = [3.100, 3.101, 3.099, 3.1005, 3.0995]
    strong = [3.090, 3.091, 3.092, 3.0905, 3.0915]
    weak = [3.0985, 3.0990, 3.0980, 3.1000, 3.0975]
    comps = [compare(base, v, n_tests=2) for v in (strong, weak)]
    ps = [c.p for c in comps]
    assert ps[0] < 0.025 and 0.025 < ps[1] < 0.05, ps
    bonf = decide_family(comps, 2, 0.05, "bonferroni")
    hol = decide_family(comps, 2, 0.05, "holm")
    assert [c.verdict for c in bonf] == ["better", "no significant difference"]
    assert [c.verdict for c in hol] == ["better", "better"]
    assert hol[1].p_holm == pytest.approx(ps[1]) and hol[0].p_holm == pytest.approx(2 * ps[0])
    assert bonf[1].p_holm == hol[1].p_holm  # Holm's p is reported under either rule
    assert decide_family([None, comps[0]], 2, 0.05, "holm")[0] is None
    with pytest.raises(ValueError):
        decide_family(comps, 2, 0.05, "sidak")  # type: ignore[arg-type]
