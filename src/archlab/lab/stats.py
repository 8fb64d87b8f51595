"""Significance of a variant's final validation loss against the baseline's seeds.

The protocol (docs METHODOLOGY, "Seeds and noise floor" and "Statistics"; docs/results.md,
"How verdicts are made", states the same rules for readers of reports):

* The **noise floor** is the sample standard deviation (ddof = 1) of the baseline's final
  validation losses over its seeds: the size of a difference that seed noise alone produces.
* Every effect is a **difference** ``mean(variant) - mean(baseline)`` (negative = lower loss =
  better), also given in noise-floor units (``z = diff / floor``).
* **Unpaired test.** With at least two seeds on both sides: Welch's t-test (unequal variances,
  Welch-Satterthwaite degrees of freedom). With a single seed on one side no variance can be
  estimated there, so Welch is undefined; we then use the pooled two-sample t-test, which for a
  sample of one is exactly the prediction-interval test of a single new observation against a
  sample (Crawford & Howell 1998): ``t = diff / (s * sqrt(1 + 1/n))`` with ``n - 1`` degrees of
  freedom. It assumes the variant's seed noise equals the baseline's, which is the best
  available assumption with one seed (and the reason suites should give variants more seeds).
* **Paired test.** A variant run and a baseline run with the same (init seed, data seed) saw the
  same batches in the same order, so their losses share that part of the noise. With at least two
  such pairs the paired t-test on the per-pair differences ``d`` (``t = mean(d) / (sd(d) /
  sqrt(n))``, ``n - 1`` degrees of freedom; scipy's ``ttest_rel``) is computed too.
* **Which test decides.** The paired test on every (init seed, data seed) pair the variant's
  finished runs share with the baseline's, whenever there are at least two such pairs; a seed
  one side has and the other lacks is left out of that test (the baseline's unpaired seeds still
  give the noise floor, and the unpaired test over all runs is shown beside it). Pairs that exist
  are never thrown away: a baseline with seeds [0, 1, 2, 3] against a variant with [0, 1, 2]
  decides on 3 pairs, where the shared batches and data order cancel from each difference. Below
  two pairs the unpaired test decides. The rule depends on which runs finished, never on their
  losses, so it cannot be steered by the outcome. Both tests are always reported.
* The **95% confidence interval** of the difference uses the deciding test's standard error and
  degrees of freedom. It is not widened for multiple comparisons; the verdict is.
* **Multiple comparisons** over the ``m`` variants of the suite: Bonferroni
  ``p_adj = min(1, m p)`` and Holm's step-down ``p_holm(i) = max_{j <= i} min(1, (m - j + 1)
  p(j))`` over the p-values sorted ascending. A variant whose p is not known yet (pending) counts
  as the largest p, which can only make the others' Holm p larger (conservative). The suite's
  ``eval.adjust`` says which one decides (default: Bonferroni, the METHODOLOGY rule; Holm controls
  the same family-wise error rate and rejects at least as often); a variant is "better" or
  "worse" only if its adjusted p < alpha.
* **Minimum detectable effect** (MDE): the smallest true difference the deciding test finds with
  probability ``power`` (0.8) at the two-sided level ``alpha / m`` (Bonferroni; a Holm decision
  needs at most this), for the suite's planned seed counts. With ``se`` the test's standard error
  and ``df`` its degrees of freedom, the MDE is ``lambda * se`` where ``lambda`` solves
  ``P(|T| > t_crit) = power`` for ``T`` noncentral t with ``df`` degrees of freedom and
  noncentrality ``lambda``, ``t_crit`` the ``1 - alpha / (2 m)`` quantile of the central t
  (roughly ``(t_crit + t_power) * se``). Unpaired: ``se = floor * sqrt(1/n_b + 1/n_v)``,
  ``df = n_b + n_v - 2`` (equal seed noise: the planning assumption); paired: ``se = sd(d) /
  sqrt(n)``, ``df = n - 1``, from the variant's own differences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Hashable, Literal, Sequence

import numpy as np
from scipy import stats as sps
from scipy.optimize import brentq

# the multiple-comparison adjustments; the suite file's eval.adjust names one (defined there so that
# reading a suite imports no scipy)
from archlab.lab.suite import ADJUSTMENTS

Verdict = Literal["better", "worse", "no significant difference", "insufficient seeds", "undetermined",
                  "not valid: seeds changed after results",  # archlab.lab.stoprule
                  "no verdict: baseline at chance"]  # downstream verdicts (archlab.lab.report.downstream)
Method = Literal["welch", "pooled (single seed)", "paired", "none"]
Adjust = Literal["bonferroni", "holm"]
POWER = 0.8  # the conventional power of the minimum detectable effect

SeedKey = Hashable  # one run's (init seed, data seed): what pairs a variant run with a baseline run


@dataclass(frozen=True)
class TTest:
    """One t-test of ``mean(variant) - mean(baseline)``: statistic, degrees of freedom, two-sided
    p and the 95% confidence interval of the difference it tests (``diff``)."""

    method: Method
    n: int  # pairs (paired) or total runs (unpaired)
    diff: float
    se: float
    t: float
    df: float
    p: float
    ci_low: float
    ci_high: float


@dataclass(frozen=True)
class Comparison:
    """One variant against the baseline; ``None`` where the seeds do not allow a number.

    ``method``, ``t``, ``df``, ``p``, the CI and ``p_adjusted`` are the deciding test's
    (``paired`` when at least two seed pairs are shared, else ``unpaired``); ``p_adjusted`` is
    Bonferroni's and ``p_holm`` Holm's (None until ``decide_family`` has seen the whole suite).
    ``n_pairs``: the seed pairs the two sides share (what the paired test is over)."""

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
    unpaired: TTest | None = None
    paired: TTest | None = None
    p_holm: float | None = None
    mde: float | None = None  # of the deciding test at the suite's planned seeds (see module doc)
    adjust: Adjust = "bonferroni"
    n_pairs: int = 0
    lower_is_better: bool = True  # a loss (the default); False for an accuracy


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


def _ttest(method: Method, n: int, diff: float, se: float, df: float) -> TTest | None:
    if not (se > 0 and math.isfinite(df) and df > 0):
        return None  # identical values: no spread to test against
    t = diff / se
    half = float(sps.t.ppf(0.975, df)) * se
    return TTest(method=method, n=n, diff=diff, se=se, t=t, df=df, p=float(2.0 * sps.t.sf(abs(t), df)),
                 ci_low=diff - half, ci_high=diff + half)


def unpaired_test(baseline: Sequence[float], variant: Sequence[float]) -> TTest | None:
    """Welch (pooled with a single seed on one side); None below three runs or without spread."""
    a, b = np.asarray(baseline, dtype=np.float64), np.asarray(variant, dtype=np.float64)
    if len(a) == 0 or len(b) == 0 or len(a) + len(b) < 3:
        return None
    se, df, method = _standard_error(a, b)
    return _ttest(method, len(a) + len(b), float(b.mean() - a.mean()), se, df)


def paired_test(diffs: Sequence[float]) -> TTest | None:
    """The paired t-test on per-pair differences (variant - baseline); None below two pairs or
    when every difference is the same."""
    d = np.asarray(diffs, dtype=np.float64)
    if len(d) < 2:
        return None
    return _ttest("paired", len(d), float(d.mean()), float(d.std(ddof=1)) / math.sqrt(len(d)), float(len(d) - 1))


def pairs(baseline: Sequence[float], variant: Sequence[float], baseline_keys: Sequence[SeedKey],
          variant_keys: Sequence[SeedKey]) -> tuple[list[float], bool]:
    """(variant - baseline for every seed key both sides have, whether pairing is complete: both
    sides have exactly the same keys, each once)."""
    if len(baseline_keys) != len(baseline) or len(variant_keys) != len(variant):
        raise ValueError("one seed key per value is needed on both sides")
    base = dict(zip(baseline_keys, baseline))
    var = dict(zip(variant_keys, variant))
    unique = len(base) == len(baseline) and len(var) == len(variant)
    diffs = [var[k] - base[k] for k in variant_keys if k in base]
    return diffs, unique and set(base) == set(var)


def detectable_effect(se: float, df: float, alpha: float, power: float = POWER) -> float:
    """The true difference a two-sided t-test at level ``alpha`` with standard error ``se`` and
    ``df`` degrees of freedom detects with probability ``power``: ``lambda * se`` with ``lambda``
    the noncentrality at which ``P(|T| > t_crit) = power`` (module doc)."""
    if not (se >= 0 and df > 0 and 0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"detectable_effect needs se >= 0, df > 0, alpha and power in (0, 1); "
                         f"got se={se}, df={df}, alpha={alpha}, power={power}")
    crit = float(sps.t.ppf(1.0 - alpha / 2.0, df))

    def reach(lam: float) -> float:
        # The far (wrong-sign) tail is negligible here, and scipy returns NaN for it at large
        # noncentrality: count it as 0 then.
        far = float(sps.nct.cdf(-crit, df, lam))
        return float(sps.nct.sf(crit, df, lam)) + (far if math.isfinite(far) else 0.0) - power

    hi = crit + float(sps.norm.ppf(power)) + 1.0
    while reach(hi) < 0:  # very few degrees of freedom: the t tails are heavy
        hi *= 2.0
    return float(brentq(reach, 0.0, hi, xtol=1e-12)) * se


def mde_unpaired(floor: float, n_baseline: int, n_variant: int, alpha: float, power: float = POWER) -> float | None:
    """MDE of the unpaired test for ``n_baseline`` and ``n_variant`` seeds, seed noise ``floor``
    on both sides (pooled degrees of freedom); None below three runs."""
    if n_baseline < 1 or n_variant < 1 or n_baseline + n_variant < 3:
        return None
    se = floor * math.sqrt(1.0 / n_baseline + 1.0 / n_variant)
    return detectable_effect(se, n_baseline + n_variant - 2, alpha, power)


def mde_paired(sd_diff: float, n_pairs: int, alpha: float, power: float = POWER) -> float | None:
    """MDE of the paired test over ``n_pairs`` pairs whose differences have sd ``sd_diff``."""
    if n_pairs < 2:
        return None
    return detectable_effect(sd_diff / math.sqrt(n_pairs), n_pairs - 1, alpha, power)


def holm(ps: Sequence[float | None], m: int | None = None) -> list[float | None]:
    """Holm's step-down adjusted p-values, in the input order, over a family of ``m`` tests
    (default: ``len(ps)``); ``None`` (a test not made yet) counts as the largest p and stays None."""
    m = len(ps) if m is None else m
    known = sorted((p, i) for i, p in enumerate(ps) if p is not None)
    if len(known) > m:
        raise ValueError(f"{len(known)} p-values for a family of {m} tests")
    out: list[float | None] = [None] * len(ps)
    running = 0.0
    for j, (p, i) in enumerate(known):
        running = max(running, min(1.0, (m - j) * p))
        out[i] = running
    return out


def _verdict(diff: float, p_adj: float, alpha: float, lower_is_better: bool = True) -> Verdict:
    if p_adj < alpha:
        return "better" if (diff < 0) == lower_is_better else "worse"
    return "no significant difference"


def compare(
    baseline: Sequence[float], variant: Sequence[float], n_tests: int, alpha: float = 0.05, *,
    baseline_keys: Sequence[SeedKey] | None = None, variant_keys: Sequence[SeedKey] | None = None,
    planned: tuple[int, int] | None = None, power: float = POWER, lower_is_better: bool = True,
) -> Comparison:
    """Test ``variant`` against ``baseline`` (final losses, one per seed); see the module doc.

    ``baseline_keys`` / ``variant_keys``: each run's seed pair, for the paired test (without
    them only the unpaired test is made). ``planned``: the suite's (baseline, variant) seed counts
    for the unpaired MDE (default: the finished counts). The verdict here is Bonferroni's;
    ``decide_family`` adds Holm's p and applies the suite's adjustment. ``lower_is_better``: False
    for a score such as accuracy (a significant positive difference is then "better")."""
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
    unpaired = unpaired_test(a, b)
    paired, diffs = None, []
    if baseline_keys is not None and variant_keys is not None:
        diffs, _complete = pairs(list(a), list(b), baseline_keys, variant_keys)
        paired = paired_test(diffs)
    level = alpha / n_tests
    if len(diffs) >= 2:  # every shared pair decides, whether or not each side has more seeds
        decider: TTest | None = paired
        method: Method = "paired"
        sd = float(np.std(diffs, ddof=1))
        mde = mde_paired(sd, len(diffs), level, power) if sd > 0 else None
    else:
        decider = unpaired
        method = "none" if len(a) + len(b) < 3 else unpaired.method if unpaired else (
            "welch" if min(len(a), len(b)) >= 2 else "pooled (single seed)")
        nb, nv = planned or (len(a), len(b))
        mde = mde_unpaired(floor, nb, nv, level, power) if floor else None
    extra = dict(unpaired=unpaired, paired=paired, mde=mde, n_pairs=len(diffs), lower_is_better=lower_is_better)
    if method == "none":
        return Comparison(**base, method=method, t=None, df=None, p=None, ci_low=None, ci_high=None,
                          p_adjusted=None, verdict="insufficient seeds", **extra)
    if decider is None:
        return Comparison(**base, method=method, t=None, df=None, p=None, ci_low=None, ci_high=None,
                          p_adjusted=None, verdict="undetermined", **extra)
    p_adj = min(1.0, decider.p * n_tests)
    return Comparison(**base, method=method, t=decider.t, df=decider.df, p=decider.p, ci_low=decider.ci_low,
                      ci_high=decider.ci_high, p_adjusted=p_adj, verdict=_verdict(diff, p_adj, alpha, lower_is_better),
                      **extra)


def decide_family(comparisons: Sequence[Comparison | None], n_tests: int, alpha: float,
                  adjust: Adjust = "bonferroni") -> list[Comparison | None]:
    """The suite's comparisons (None: a variant without results yet) with Holm's p filled in and
    the verdict by ``adjust`` (Bonferroni's, as ``compare`` made it, or Holm's)."""
    if adjust not in ADJUSTMENTS:
        raise ValueError(f"unknown adjustment {adjust!r}; known: {', '.join(ADJUSTMENTS)}")
    held = holm([None if c is None else c.p for c in comparisons], max(n_tests, len(comparisons)))
    out: list[Comparison | None] = []
    for c, ph in zip(comparisons, held):
        if c is None:
            out.append(None)
            continue
        verdict = c.verdict
        if adjust == "holm" and ph is not None:
            verdict = _verdict(c.diff, ph, alpha, c.lower_is_better)
        out.append(replace(c, p_holm=ph, verdict=verdict, adjust=adjust))
    return out
