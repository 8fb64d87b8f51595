"""What a report shows, gathered from the results database: per baseline or variant its planned,
finished, running and interrupted runs, final losses, costs, downstream, held-out and latency
results and its test against the baseline (``LabelSummary``), the suite's plan and statistics
around them (``ReportData``), and ``collect``, which builds them from a ``ResultStore``. No
formatting here: the tables are ``archlab.lab.report.tables``, the prose
``archlab.lab.report.text``, the files and the console ``archlab.lab.report``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from archlab.errors import ArchlabError
from archlab.lab.stats import Comparison, compare, decide_family, noise_floor
from archlab.lab.stoprule import INVALID, seed_plan_changes
from archlab.lab.store import DownstreamRow, LatencyRow, ResultStore, RunRow, display_status


@dataclass(frozen=True)
class LabelSummary:
    """One baseline or variant: its runs, final losses and costs, and its test against the baseline."""

    label: str
    role: str
    planned: int
    finished: list[RunRow]
    diverged: int
    running: int  # being trained now (a live claim)
    costs: dict[str, Any]
    comparison: Comparison | None
    downstream: dict[str, list[DownstreamRow]] = field(default_factory=dict)  # task -> one per seed
    interrupted: int = 0  # started, not finished, and the process training it is gone
    latency: dict[tuple[str, int], LatencyRow] = field(default_factory=dict)  # (phase, batch) -> row

    @property
    def losses(self) -> list[float]:
        return [r.final_val_loss for r in self.finished if r.final_val_loss is not None]

    @property
    def bpbs(self) -> list[float]:
        return [r.final_val_bpb for r in self.finished if r.final_val_bpb is not None]

    @property
    def mean_loss(self) -> float | None:
        return statistics.fmean(self.losses) if self.losses else None

    @property
    def sd_loss(self) -> float | None:
        return statistics.stdev(self.losses) if len(self.losses) > 1 else None

    @property
    def tokens_per_s(self) -> float | None:
        rates = [r.tokens_per_s for r in self.finished if r.tokens_per_s]
        return statistics.median(rates) if rates else None

    @property
    def runs_at_once(self) -> str:
        """How many runs shared the host while this label's runs trained: one value, a range
        over the seeds, or ``-`` when no finished run recorded it."""
        known = sorted({r.runs_at_once for r in self.finished if r.runs_at_once})
        if not known:
            return "-"
        return str(known[0]) if len(known) == 1 else f"{known[0]}-{known[-1]}"

    def task_mean(self, task: str) -> float | None:
        """Mean over seeds of the task's headline metric (acc_norm, or acc for LAMBADA)."""
        rows = self.downstream.get(task, [])
        return statistics.fmean(d.value for d in rows) if rows else None

    def task_se(self, task: str) -> tuple[float | None, bool]:
        """(standard error of ``task_mean``, whether it is over seeds): the seeds' sample standard
        deviation / sqrt(seeds), or with a single seed the binomial standard error over items."""
        rows = self.downstream.get(task, [])
        if len(rows) > 1:
            return statistics.stdev(d.value for d in rows) / math.sqrt(len(rows)), True
        return (rows[0].stderr if rows else None), False

    @property
    def verdict(self) -> str:
        if self.role == "baseline":
            return "baseline"
        if self.comparison is not None:
            return self.comparison.verdict
        if self.diverged and not self.finished:
            return "diverged"
        return "pending"


@dataclass(frozen=True)
class ReportData:
    """One budget of a suite (a suite with several token budgets gives one ``ReportData`` per
    budget, ``collect_budgets``); ``plan["runs"]`` holds that budget's runs only."""

    plan: dict[str, Any]
    summaries: list[LabelSummary]
    floor: float | None
    n_tests: int
    alpha: float
    rows: list[RunRow]
    tasks: list[str] = field(default_factory=list)  # the suite's downstream tasks (eval.tasks)
    adjust: str = "bonferroni"  # which adjusted p decides (eval.adjust)
    seed_changes: list[dict[str, Any]] = field(default_factory=list)  # stoprule: seeds changed after results
    heldout: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # label -> corpus -> losses
    budget: int | None = None  # this report's token budget (the suite's budget.tokens, one of them)
    budgets: tuple[int, ...] = ()  # every budget of the suite
    downstream_verdicts: Any = None  # archlab.lab.report.downstream.DownstreamVerdicts (None: no tasks)

    @property
    def suite(self) -> dict[str, Any]:
        return self.plan["suite"]

    @property
    def measure(self) -> dict[str, Any]:
        """The suite's latency settings (a plan stored before they existed: their defaults)."""
        c = self.suite.get("costs") or {}
        return {"measure": c.get("measure", "auto"), "prompt": c.get("prompt", 2048),
                "batches": list(c.get("batches", [1, 8])), "steps": c.get("steps", 100)}

    @property
    def measured(self) -> bool:
        return any(s.latency for s in self.summaries)

    @property
    def baseline(self) -> LabelSummary:
        return self.summaries[0]

    @property
    def multi_budget(self) -> bool:
        return len(self.budgets) > 1

    @property
    def name(self) -> str:
        """The suite's name, with this budget when the suite has several (``trend`` points)."""
        from archlab.lab.fmt import si

        return self.suite["name"] + (f" @{si(self.budget)} tokens" if self.multi_budget else "")


def budgets_of(plan: dict[str, Any]) -> tuple[int, ...]:
    """The token budgets of a stored plan, ascending (a plan stored before multi-budget suites:
    its one ``budget.tokens``)."""
    tokens = plan["suite"]["budget"]["tokens"]
    default = tokens if isinstance(tokens, int) else None
    found = sorted({p.get("budget") or default for p in plan["runs"]} - {None})
    return tuple(found) or (tuple(tokens) if isinstance(tokens, list) else (int(tokens),))


def collect_budgets(store: ResultStore) -> list[ReportData]:
    """One ``ReportData`` per token budget of the suite, shortest first."""
    plan = store.get_meta("plan")
    if plan is None:
        raise ArchlabError(f"{store.path} holds no suite plan (run archlab compare first)")
    return [collect(store, budget=b) for b in budgets_of(plan)]


def collect(store: ResultStore, budget: int | None = None) -> ReportData:
    """Gather the suite's planned runs, their rows and the statistics, at ``budget`` (one of the
    suite's token budgets; default: the longest)."""
    plan = store.get_meta("plan")
    if plan is None:
        raise ArchlabError(f"{store.path} holds no suite plan (run archlab compare first)")
    budgets = budgets_of(plan)
    budget = budgets[-1] if budget is None else budget
    if budget not in budgets:
        raise ArchlabError(f"{store.path}: the suite has no budget of {budget} tokens (it has "
                           f"{', '.join(map(str, budgets))})")
    plan = {**plan, "runs": [p for p in plan["runs"] if (p.get("budget") or budgets[0]) == budget]}
    by_id = {r.run_id: r for r in store.runs()}
    live = store.live_claims()
    planned = plan["runs"]
    suite = plan["suite"]
    n_tests = max(1, len(suite["variants"]))
    alpha = float(suite["eval"]["alpha"])
    adjust = suite["eval"].get("adjust", "bonferroni")
    base_planned = sum(p["label"] == plan["labels"][0] for p in planned)
    rows = [by_id[p["run_id"]] for p in planned if p["run_id"] in by_id]
    # Downstream results for the suite's current tasks and item limit (a suite from before
    # downstream evaluation existed has neither).
    tasks = list(suite["eval"].get("tasks") or [])
    limit = suite["eval"].get("limit")
    evals: dict[str, dict[str, DownstreamRow]] = {}
    for d in store.downstream():
        if d.task in tasks and d.limit == limit:
            evals.setdefault(d.run_id, {})[d.task] = d
    # Measured latency at the suite's current shapes (prompt, batches, context).
    costs = suite.get("costs") or {}
    prompt, batches = costs.get("prompt", 2048), list(costs.get("batches", [1, 8]))
    timed: dict[str, dict[tuple[str, int, int], LatencyRow]] = {}
    for t in store.latency():
        timed.setdefault(t.run_id, {}).setdefault(t.shape, t)

    def latency(mine: list[dict[str, Any]], done: list[RunRow]) -> dict[tuple[str, int], LatencyRow]:
        """Per shape, the first finished run (plan order) that has it: one run per label."""
        wanted = [("prefill", 1, prompt)] + [("decode", b, mine[0]["cost_context"]) for b in batches]
        out: dict[tuple[str, int], LatencyRow] = {}
        for key in wanted:
            for r in done:
                if key in timed.get(r.run_id, {}):
                    out[(key[0], key[1])] = timed[r.run_id][key]
                    break
        return out

    def summary(label: str, base: LabelSummary | None) -> LabelSummary:
        mine = [p for p in planned if p["label"] == label]
        got = [by_id[p["run_id"]] for p in mine if p["run_id"] in by_id]
        done = [r for r in got if r.status == "finished"]
        losses = [r.final_val_loss for r in done]
        comp = None
        if base is not None and base.losses and losses:
            # Runs pair by (init seed, data seed): the same initialisation seed and batch order.
            comp = compare(base.losses, losses, n_tests, alpha,
                           baseline_keys=[(r.init_seed, r.data_seed) for r in base.finished],
                           variant_keys=[(r.init_seed, r.data_seed) for r in done],
                           planned=(base_planned, len(mine)))
        return LabelSummary(label=label, role=mine[0]["role"], planned=len(mine), finished=done,
                            diverged=sum(r.status == "diverged" for r in got),
                            running=sum(display_status(r, live) == "running" for r in got),
                            interrupted=sum(display_status(r, live) == "interrupted" for r in got),
                            costs=mine[0]["costs"], comparison=comp,
                            downstream={t: [evals[r.run_id][t] for r in done if t in evals.get(r.run_id, {})]
                                        for t in tasks},
                            latency=latency(mine, done))

    labels = plan["labels"]
    base = summary(labels[0], None)
    variants = [summary(lbl, base) for lbl in labels[1:]]
    decided = decide_family([v.comparison for v in variants], n_tests, alpha, adjust)
    changes = seed_plan_changes(store)
    if changes:  # a stop rule broken: the tests are still shown, no verdict is drawn from them
        decided = [None if c is None else replace(c, verdict=INVALID) for c in decided]
    summaries = [base] + [replace(v, comparison=c) for v, c in zip(variants, decided)]
    heldout: dict[str, dict[str, list[float]]] = {}
    for h in store.heldout():
        row = by_id.get(h.run_id)
        if row is not None and row.status == "finished" and h.corpus in (suite.get("eval_data") or {}):
            heldout.setdefault(row.label, {}).setdefault(h.corpus, []).append(h.loss)
    data = ReportData(plan=plan, summaries=summaries, floor=noise_floor(base.losses), n_tests=n_tests,
                      alpha=alpha, rows=rows, tasks=tasks, adjust=adjust, seed_changes=changes,
                      heldout=heldout, budget=budget, budgets=budgets)
    if tasks:
        from archlab.lab.report.downstream import downstream_verdicts

        data = replace(data, downstream_verdicts=downstream_verdicts(data))
    return data
