"""Significance of a variant's final validation loss against the baseline's seeds.

The protocol (docs METHODOLOGY, "Seeds and noise floor" and "Statistics"):

* The **noise floor** is the sample standard deviation (ddof = 1) of the baseline's final
  validation losses over its seeds: the size of a difference that seed noise alone produces.
* Every effect is a **difference** ``mean(variant) - mean(baseline)`` (negative = lower loss =
  better), also given in noise-floor units (``z = diff / floor``).
* **Test.** With at least two seeds on both sides: Welch's t-test (unequal variances,
  Welch-Satterthwaite degrees of freedom). With a single seed on one side no variance can be
  estimated there, so Welch is undefined; we then use the pooled two-sample t-test, which for a
  sample of one is exactly the prediction-interval test of a single new observation against a
  sample (Crawford & Howell 1998): ``t = diff / (s * sqrt(1 + 1/n))`` with ``n - 1`` degrees of
  freedom. It assumes the variant's seed noise equals the baseline's, which is the best
  available assumption with one seed (and the reason suites should give variants more seeds).
* The **95% confidence interval** of the difference uses the same standard error and degrees of
  freedom as the test. It is not widened for multiple comparisons; the verdict is.
* **Bonferroni.** ``p_adjusted = min(1, p * n_tests)`` with ``n_tests`` the number of variants in
  the suite; a variant is "better" or "worse" only if ``p_adjusted < alpha``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
from scipy import stats as sps

Verdict = Literal["better", "worse", "no significant difference", "insufficient seeds", "undetermined"]
Method = Literal["welch", "pooled (single seed)", "none"]


@dataclass(frozen=True)
class Comparison:
    """One variant against the baseline; ``None`` where the seeds do not allow a number."""

    n_baseline: int
    n_variant: int
    mean_baseline: float
    mean_variant: float
    diff: float
    z: float | None
    method: Method
    t: float | None
    df: float | None
    p: float | None
    ci_low: float | None
    ci_high: float | None
    p_adjusted: float | None
    verdict: Verdict


def noise_floor(baseline: Sequence[float]) -> float | None:
    """Seed-to-seed sample standard deviation of the baseline; None below two seeds."""
    if len(baseline) < 2:
        return None
    return float(np.std(np.asarray(baseline, dtype=np.float64), ddof=1))


def _standard_error(a: np.ndarray, b: np.ndarray) -> tuple[float, float, Method]:
    """(standard error of mean(b) - mean(a), degrees of freedom, method)."""
    na, nb = len(a), len(b)
    if na >= 2 and nb >= 2:
        va, vb = a.var(ddof=1) / na, b.var(ddof=1) / nb
        se2 = va + vb
        df = se2**2 / (va**2 / (na - 1) + vb**2 / (nb - 1)) if se2 > 0 else float("nan")
        return math.sqrt(se2), float(df), "welch"
    # One side has a single seed: pooled variance comes from the other side alone.
    many = a if na >= 2 else b
    s2 = many.var(ddof=1)
    return math.sqrt(s2 * (1.0 / na + 1.0 / nb)), float(len(many) - 1), "pooled (single seed)"


def compare(
    baseline: Sequence[float], variant: Sequence[float], n_tests: int, alpha: float = 0.05
) -> Comparison:
    """Test ``variant`` against ``baseline`` (final losses, one per seed); see the module doc."""
    if n_tests < 1:
        raise ValueError(f"n_tests must be >= 1, got {n_tests}")
    a = np.asarray(baseline, dtype=np.float64)
    b = np.asarray(variant, dtype=np.float64)
    if len(a) == 0 or len(b) == 0:
        raise ValueError("both samples need at least one value")
    diff = float(b.mean() - a.mean())
    floor = noise_floor(baseline)
    z = diff / floor if floor else None
    base = dict(n_baseline=len(a), n_variant=len(b), mean_baseline=float(a.mean()),
                mean_variant=float(b.mean()), diff=diff, z=z)
    if len(a) + len(b) < 3:
        return Comparison(**base, method="none", t=None, df=None, p=None, ci_low=None,
                          ci_high=None, p_adjusted=None, verdict="insufficient seeds")
    se, df, method = _standard_error(a, b)
    if not (se > 0 and math.isfinite(df)):
        # Identical values on both sides: no spread to test against.
        return Comparison(**base, method=method, t=None, df=None, p=None, ci_low=None,
                          ci_high=None, p_adjusted=None, verdict="undetermined")
    t = diff / se
    p = float(2.0 * sps.t.sf(abs(t), df))
    half = float(sps.t.ppf(0.975, df)) * se
    p_adj = min(1.0, p * n_tests)
    verdict: Verdict = "no significant difference"
    if p_adj < alpha:
        verdict = "better" if diff < 0 else "worse"
    return Comparison(**base, method=method, t=t, df=df, p=p, ci_low=diff - half,
                      ci_high=diff + half, p_adjusted=p_adj, verdict=verdict)
