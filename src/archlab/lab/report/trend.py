"""How a verdict moves between model sizes or training lengths: the same comparison at two or
more points.

``archlab trend SMALL_DIR LARGE_DIR`` reads finished suite directories (each with its own
baseline) and prints, for every variant label they share, its effect in each suite (variant minus
that suite's baseline, final validation loss), the deciding test's adjusted p and verdict as that
suite's report states them, and the **change** of the effect from the first suite to the last.
A suite with several token budgets (``budget.tokens: [6.5M, 20M, 57M]``) is one point per budget,
shortest first: ``archlab trend DIR`` on it alone is the effect against training length.

The change is tested on the per-seed differences: in each suite, a variant run and the baseline run
with the same (init seed, data seed) give one difference (unpaired suites: variant seeds minus the
baseline's mean); the two samples of differences are compared with Welch's t-test, and Holm's
step-down adjusts the p over the shared labels (a family fixed by the suites, not by the results).
The trend's verdict: **holds** when the change is not significant (Holm's p >= alpha, the first
point's alpha), else **shrinks** when the effect's magnitude fell, **grows** when it rose, and
**reverses** when the last point's effect has the other sign and is itself significant.
A point where a label has no finished run yet (a suite whose longest budget is still training)
is shown as "-" and left out of its change: the change runs from the first point to the last
one *measured*, and the change column names the two (``6.55M->20M``) whenever that is not the
first and the last point, so a suite in progress already says how its effects move.
The suites' runs are separate trainings, but suites that share seeds and data orders are not
fully independent; Welch's test ignores that, which makes it conservative when the shared data
order moves both sizes the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from archlab.errors import ArchlabError, UsageError
from archlab.lab import stats
from archlab.lab.fmt import si
from archlab.lab.report.data import ReportData, collect_budgets
from archlab.lab.store import DB_NAME, ResultStore

if TYPE_CHECKING:
    from rich.table import Table


@dataclass(frozen=True)
class SizePoint:
    """One label in one suite."""

    suite: str  # the point's name: the suite's, with its budget when the suite has several
    params: int | None
    effect: float | None  # mean(variant) - mean(baseline)
    p_adjusted: float | None  # the suite's deciding adjusted p (its eval.adjust)
    verdict: str
    diffs: tuple[float, ...]  # per-seed differences against the baseline
    tokens: int | None = None  # the point's token budget
    ci: tuple[float, float] | None = None  # 95% CI of the effect (the deciding test's)


@dataclass(frozen=True)
class TrendRow:
    label: str
    points: tuple[SizePoint, ...]
    change: float | None  # effect(last measured) - effect(first measured)
    p: float | None  # Welch on the per-seed differences, first against last measured
    p_holm: float | None = None
    verdict: str = "-"  # holds, shrinks, grows or reverses (module doc)
    span: str = ""  # "first->last" when the change is not between the first and the last point

    def change_cell(self) -> str:
        if self.change is None:
            return "-"
        return f"{self.change:+.4f}" + (f" ({self.span})" if self.span else "")


def _differences(data: ReportData, label: str) -> tuple[float, ...]:
    """Per-seed differences against the baseline: by seed pair where the suite's own verdict
    pairs them (at least two shared pairs, ``stats.compare``), else against the baseline's mean."""
    base = data.baseline.finished
    mine = next(s for s in data.summaries if s.label == label).finished
    key = lambda r: (r.init_seed, r.data_seed)  # noqa: E731
    diffs, _complete = stats.pairs([r.final_val_loss for r in base], [r.final_val_loss for r in mine],
                                   [key(r) for r in base], [key(r) for r in mine])
    if len(diffs) >= 2:
        return tuple(diffs)
    mean = float(np.mean([r.final_val_loss for r in base])) if base else float("nan")
    return tuple(r.final_val_loss - mean for r in mine)


def _point(data: ReportData, label: str) -> SizePoint:
    s = next(s for s in data.summaries if s.label == label)
    c = s.comparison
    adjusted = None if c is None else (c.p_holm if data.adjust == "holm" else c.p_adjusted)
    params = s.costs.get("params_total") if s.costs else None
    ci = None if c is None or c.ci_low is None else (c.ci_low, c.ci_high)
    return SizePoint(suite=data.name, params=None if params is None else int(params),
                     effect=None if c is None else c.diff, p_adjusted=adjusted, verdict=s.verdict,
                     diffs=_differences(data, label), tokens=data.budget, ci=ci)


def check_distinct(dirs: list[Path]) -> None:
    """Refuse a suite directory given twice (also through another spelling or a symlink): its
    points against themselves would show a change of exactly zero, which reads as a result."""
    seen: dict[Path, Path] = {}
    for d in dirs:
        key = Path(d).resolve()
        if key in seen:
            same = "twice" if str(seen[key]) == str(d) else f"twice ({seen[key]} and {d} are the same directory)"
            raise UsageError(f"trend: {d} is given {same}; a trend compares different suite directories "
                             "(smallest model first), or the token budgets of one suite given once")
        seen[key] = Path(d)


def load_suite_dir(path: Path) -> list[ReportData]:
    """A suite directory's points: one per token budget, shortest first."""
    db = Path(path) / DB_NAME
    if not db.is_file():
        raise UsageError(f"{path} is not a suite directory (no {DB_NAME}; run archlab compare first)")
    with ResultStore(db) as store:
        return collect_budgets(store)


def trend_verdict(first: SizePoint, last: SizePoint, p_holm: float | None, alpha: float) -> str:
    """holds / shrinks / grows / reverses (module doc)."""
    if p_holm is None or first.effect is None or last.effect is None:
        return "-"
    if p_holm >= alpha:
        return "holds (no significant change)"
    if first.effect * last.effect < 0 and last.verdict in ("better", "worse"):
        return "reverses"
    return "shrinks" if abs(last.effect) < abs(first.effect) else "grows"


def trend(suites: list[ReportData]) -> list[TrendRow]:
    """Every variant label shared by all ``suites`` (in the order given: smallest model first)."""
    if len(suites) < 2:
        raise ArchlabError("trend needs at least two points: two suite directories, or one suite with "
                           "several token budgets")
    variants = [[s.label for s in d.summaries[1:]] for d in suites]
    shared = [label for label in variants[0] if all(label in v for v in variants[1:])]
    if not shared:
        raise ArchlabError("the suites share no variant label: a trend compares the same variants")
    by_budget = len({d.suite["name"] for d in suites}) == 1  # the budgets of one suite
    rows, ends = [], []
    for label in shared:
        points = tuple(_point(d, label) for d in suites)
        measured = [i for i, pt in enumerate(points) if pt.effect is not None]
        change = p = None
        span = ""
        if len(measured) >= 2:
            first, last = points[measured[0]], points[measured[-1]]
            change = last.effect - first.effect
            test = stats.unpaired_test(first.diffs, last.diffs)
            p = None if test is None else test.p
            if (measured[0], measured[-1]) != (0, len(points) - 1):
                name = (lambda pt: si(pt.tokens)) if by_budget else (lambda pt: pt.suite)
                span = f"{name(first)}->{name(last)}"
            ends.append((first, last))
        else:
            ends.append((points[0], points[-1]))
        rows.append(TrendRow(label=label, points=points, change=change, p=p, span=span))
    adjusted = stats.holm([r.p for r in rows])
    alpha = suites[0].alpha
    return [TrendRow(r.label, r.points, r.change, r.p, h, trend_verdict(first, last, h, alpha), r.span)
            for r, h, (first, last) in zip(rows, adjusted, ends)]



def markdown(rows: list[TrendRow]) -> str:
    """The trend as a Markdown table (what ``archlab trend --md`` prints)."""
    names = [p.suite for p in rows[0].points]
    head = ["variant", *[f"Δ {n} (adj. p, verdict)" for n in names], "change", "p (Welch)", "p Holm", "trend"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.label]
        for p in r.points:
            cells.append("-" if p.effect is None else f"{p.effect:+.4f} ({_p(p.p_adjusted)}, {p.verdict})")
        cells += [r.change_cell(), _p(r.p), _p(r.p_holm), r.verdict]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _p(p: float | None) -> str:
    if p is None:
        return "-"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def trend_table(rows: list[TrendRow]) -> "Table":
    """The trend as a rich table (``archlab trend``, and the console report of a multi-budget suite)."""
    from rich.table import Table

    names = [p.suite for p in rows[0].points]
    table = Table(title="effect against each point's baseline (final validation loss; negative is better)")
    for col in ["variant", *[f"Δ {n}" for n in names], "change", "p Welch", "p Holm", "trend"]:
        table.add_column(col, justify="left" if col in ("variant", "trend") else "right")
    for r in rows:
        cells = [r.label]
        cells += ["-" if p.effect is None else f"{p.effect:+.4f} {p.verdict}" for p in r.points]
        cells += [r.change_cell(), _p(r.p), _p(r.p_holm), r.verdict]
        table.add_row(*cells)
    return table
