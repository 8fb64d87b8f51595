"""Downstream verdicts: a suite's zero-shot tasks as a second verdict, one per task family.

A run's score on a family is the mean of the headline metric (acc_norm for multiple choice, acc
for LAMBADA-style exact match) over the family's tasks. Each variant's scores are tested against
the baseline's exactly as losses are (``archlab.lab.stats.compare``: the paired t-test on the seed
pairs the two share, at least two; else Welch's), with higher being better, and Holm's step-down
adjusts over every (variant, family) test of the suite at once: m = variants x families.

No verdict is drawn on a family whose baseline is within its noise of chance: its mean minus the
chance level is at most twice the standard error of that mean (the seeds' spread and the tasks'
binomial item noise combined). A model that has not left chance cannot be better or worse than
another in any sense the task measures; the report says so instead of reading noise.

Chance levels: each evaluation stores its task's (the mean over items of 1 / choices for multiple
choice, 0 for exact match; ``archlab.eval.tasks.chance_level``); rows from before that use
``KNOWN_CHANCE``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from archlab.lab.stats import Comparison, compare, decide_family
from archlab.lab.stoprule import INVALID

if TYPE_CHECKING:
    from archlab.lab.report.data import LabelSummary, ReportData
    from archlab.lab.store import DownstreamRow

#: tasks that measure one kind of ability are one family, so that a suite with five tasks makes
#: three tests per variant, not five (a suite's eval.families replaces this grouping); a task
#: named in none is a family of its own
DEFAULT_FAMILIES: dict[str, tuple[str, ...]] = {
    "commonsense": ("hellaswag", "piqa", "winogrande"),
    "science-qa": ("arc_easy", "arc_challenge"),
    "lambada": ("lambada",),
}
#: chance of the headline metric for rows stored before chance levels were (4 endings, 2
#: solutions, 2 options, ARC's 4 choices in nearly every item, exact match of a word)
KNOWN_CHANCE: dict[str, float] = {"hellaswag": 0.25, "piqa": 0.5, "winogrande": 0.5, "arc_easy": 0.25,
                                  "arc_challenge": 0.25, "lambada": 0.0}
AT_CHANCE = "no verdict: baseline at chance"


def families_for(tasks: Sequence[str], configured: dict[str, Sequence[str]] | None = None) -> dict[str, tuple[str, ...]]:
    """The suite's families: ``configured`` (eval.families), or the default grouping restricted
    to the suite's tasks, in the order the tasks are listed."""
    if configured:
        return {name: tuple(members) for name, members in configured.items()}
    out: dict[str, list[str]] = {}
    for task in tasks:
        family = next((f for f, members in DEFAULT_FAMILIES.items() if task in members), task)
        out.setdefault(family, []).append(task)
    return {f: tuple(m) for f, m in out.items()}


@dataclass(frozen=True)
class FamilyResult:
    family: str
    tasks: tuple[str, ...]
    chance: float | None  # None: a task's chance level is not known
    baseline_mean: float | None
    baseline_se: float | None  # of baseline_mean: seed spread and item noise combined
    at_chance: bool
    comparisons: dict[str, Comparison | None]  # variant label -> its test (None: no scores yet)


@dataclass(frozen=True)
class DownstreamVerdicts:
    families: list[FamilyResult]
    n_tests: int  # variants x families: Holm's family-wise family
    alpha: float

    def warnings(self) -> list[str]:
        return [f"downstream {f.family}: the baseline ({f.baseline_mean:.4f} ± {f.baseline_se:.4f}) is within "
                f"twice its standard error of chance ({f.chance:.4f}); no downstream verdict is drawn on it"
                for f in self.families if f.at_chance]


def _family_scores(s: LabelSummary, tasks: tuple[str, ...]) -> dict[tuple[int, int], tuple[float, float]]:
    """Per finished run with every task of the family: (init seed, data seed) -> (mean headline
    value, its binomial standard error over the tasks' items)."""
    by_run: dict[str, dict[str, DownstreamRow]] = {}
    for task in tasks:
        for d in s.downstream.get(task, []):
            by_run.setdefault(d.run_id, {})[task] = d
    out = {}
    for r in s.finished:
        rows = by_run.get(r.run_id, {})
        if len(rows) == len(tasks):
            mean = statistics.fmean(rows[t].value for t in tasks)
            se = math.sqrt(sum(rows[t].stderr ** 2 for t in tasks)) / len(tasks)
            out[(r.init_seed, r.data_seed)] = (mean, se)
    return out


def _chance(s: LabelSummary, tasks: tuple[str, ...]) -> float | None:
    levels = []
    for task in tasks:
        stored = [d.chance for d in s.downstream.get(task, []) if d.chance is not None]
        level = stored[0] if stored else KNOWN_CHANCE.get(task)
        if level is None:
            return None
        levels.append(level)
    return statistics.fmean(levels)


def downstream_verdicts(data: ReportData) -> DownstreamVerdicts:
    families = families_for(data.tasks, data.suite["eval"].get("families"))
    variants = data.summaries[1:]
    n_tests = max(1, len(variants) * len(families))
    base = data.baseline
    pending: list[tuple[str, tuple[str, ...], float | None, float | None, float | None, bool, list[Comparison | None]]] = []
    flat: list[Comparison | None] = []
    for family, tasks in families.items():
        scores = _family_scores(base, tasks)
        chance = _chance(base, tasks)
        mean = se = None
        at_chance = False
        if scores:
            values = [v for v, _ in scores.values()]
            mean = statistics.fmean(values)
            seeds_se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
            items_se = statistics.fmean(e for _, e in scores.values())
            se = math.sqrt(seeds_se ** 2 + items_se ** 2)
            at_chance = chance is not None and mean - chance <= 2 * se
        comps: list[Comparison | None] = []
        for v in variants:
            mine = _family_scores(v, tasks)
            if not scores or not mine:
                comps.append(None)
                continue
            keys_b, keys_v = list(scores), list(mine)
            comps.append(compare([scores[k][0] for k in keys_b], [mine[k][0] for k in keys_v], n_tests,
                                 data.alpha, baseline_keys=keys_b, variant_keys=keys_v,
                                 lower_is_better=False))
        pending.append((family, tasks, chance, mean, se, at_chance, comps))
        flat += comps
    decided = iter(decide_family(flat, n_tests, data.alpha, "holm"))
    results = []
    for family, tasks, chance, mean, se, at_chance, comps in pending:
        tested = [next(decided) for _ in comps]
        if at_chance or data.seed_changes:  # a broken stop rule voids these verdicts too
            why = INVALID if data.seed_changes else AT_CHANCE
            tested = [None if c is None else replace(c, verdict=why) for c in tested]
        results.append(FamilyResult(family=family, tasks=tasks, chance=chance, baseline_mean=mean, baseline_se=se,
                                    at_chance=at_chance,
                                    comparisons={v.label: c for v, c in zip(variants, tested)}))
    return DownstreamVerdicts(families=results, n_tests=n_tests, alpha=data.alpha)
