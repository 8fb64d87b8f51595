"""Reports of a suite, built from its results database alone.

Every number in a report comes from ``results.sqlite``: the suite definition and plan stored at
``compare`` time (the ``meta`` table) and the run rows. So a report can be regenerated at any
time, while a suite is still running, or after the run directories (checkpoints) are deleted.

Outputs, next to the database: ``report.md`` (GitHub-flavoured tables, figures as PNG files in
the same directory), ``report.html`` (one self-contained file: inline CSS, figures as base64
PNG, no scripts, no external resources) and a rich table on the console.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich import box
from rich.console import Console
from rich.table import Table

from archlab.errors import ArchlabError
from archlab.lab.figures import fig_curves, fig_diffs, fig_latency, fig_tradeoff
from archlab.lab.fmt import device_hours, device_text, duration, latency_device_text, plural, si
from archlab.lab.stats import POWER, Comparison, compare, decide_family, mde_paired, mde_unpaired, noise_floor
from archlab.lab.stoprule import INVALID, seed_plan_changes
from archlab.lab.latency import fmt_ms
from archlab.lab.store import DB_NAME, DownstreamRow, LatencyRow, ResultStore, RunRow, display_status

FIGURES = (  # (file, caption); the file stem is the figure's short name
    ("loss_curves.png", "Validation loss against training tokens (training FLOPs under iso-FLOP "
                        "matching): mean over seeds, band = min to max over seeds; right, the last "
                        "half of training enlarged."),
    ("loss_diff.png", "Difference in final validation loss against the baseline (negative = better) "
                      "with 95% confidence intervals; grey bands: 1 and 2 noise floors."),
    ("tradeoff.png", "Final validation loss (mean and seed standard deviation) against prefill FLOPs "
                     "per token and against bytes read per decode step."),
)
# Added after FIGURES when the suite has measured latency (costs.measure).
LATENCY_FIGURE = ("tradeoff_measured.png",
                  "Final validation loss (mean and seed standard deviation) against decode cost, computed "
                  "(bytes read per decode step) and measured (ms per decode step at batch 1 on the "
                  "inference engine), and against measured prefill latency.")


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


def collect(store: ResultStore) -> ReportData:
    """Gather the suite's planned runs, their rows and the statistics."""
    plan = store.get_meta("plan")
    if plan is None:
        raise ArchlabError(f"{store.path} holds no suite plan (run archlab compare first)")
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
    return ReportData(plan=plan, summaries=summaries, floor=noise_floor(base.losses), n_tests=n_tests,
                      alpha=alpha, rows=rows, tasks=tasks, adjust=adjust, seed_changes=changes,
                      heldout=heldout)


# ---- formatting -------------------------------------------------------------------------------
def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def _p(p: float | None) -> str:
    if p is None:
        return "-"
    return f"{p:.1e}" if p < 1e-3 else f"{p:.3f}"


def task_metric(task: str) -> str:
    """The headline metric of a downstream task: acc for LAMBADA, else (multiple choice) acc_norm."""
    return "acc" if task == "lambada" else "acc_norm"


def _task_cell(data: ReportData, s: LabelSummary, task: str) -> str:
    """Mean over seeds, and for a variant its difference against the baseline's mean."""
    mean, base = s.task_mean(task), data.baseline.task_mean(task)
    if mean is None:
        return "-"
    if s.role == "baseline" or base is None:
        return f"{mean:.4f}"
    return f"{mean:.4f} ({mean - base:+.4f})"


def planned_seeds(data: ReportData, label: str) -> list[tuple[int, int]]:
    """The (init seed, data seed) pairs the plan gives ``label``."""
    return [(p["init_seed"], p["data_seed"]) for p in data.plan["runs"] if p["label"] == label]


def paired_design(data: ReportData, label: str) -> bool:
    """Whether the suite gives ``label`` exactly the baseline's seed pairs (a paired design)."""
    mine, base = planned_seeds(data, label), planned_seeds(data, data.baseline.label)
    return len(mine) >= 2 and sorted(mine) == sorted(base)


def mde_of(data: ReportData, s: LabelSummary) -> float | None:
    """The variant's minimum detectable effect: its comparison's, or before it has one the
    design's, from the noise floor (a paired design without differences yet: the unpaired
    figure, which assumes no correlation between paired runs and so errs large)."""
    if s.role == "baseline":
        return None
    if s.comparison is not None and s.comparison.mde is not None:
        return s.comparison.mde
    if data.floor is None:
        return None
    return mde_unpaired(data.floor, data.baseline.planned, s.planned, data.alpha / data.n_tests)


def compute_hours(rows: list[RunRow]) -> tuple[float, float]:
    """(summed wall seconds, device-hours) of the finished or diverged runs among ``rows``."""
    wall = sum(r.wall_s or 0.0 for r in rows if r.status != "running")
    return wall, sum(device_hours(r.device, r.wall_s) for r in rows if r.status != "running")


def compute_table(data: ReportData) -> tuple[list[str], list[list[str]]]:
    """What each verdict cost: the label's own runs, and for a variant its runs plus the
    baseline's (a verdict rests on both)."""
    header = ["variant", "runs", "wall time (sum)", "GPU-hours", "verdict wall time", "verdict GPU-hours"]
    base_rows = [r for r in data.rows if r.label == data.baseline.label]
    bw, bh = compute_hours(base_rows)
    out = []
    for s in data.summaries:
        mine = [r for r in data.rows if r.label == s.label]
        w, h = compute_hours(mine)
        if s.role == "baseline":
            out.append([s.label, str(len(mine)), duration(w), f"{h:.3f}", "-", "-"])
        else:
            out.append([s.label, str(len(mine)), duration(w), f"{h:.3f}", duration(w + bw), f"{h + bh:.3f}"])
    return header, out


def heldout_table(data: ReportData) -> tuple[list[str], list[list[str]]]:
    """In-distribution validation loss next to each extra corpus's (eval_data), mean over seeds,
    a variant's difference against the baseline's mean in brackets."""
    corpora = sorted(data.suite.get("eval_data") or {})  # the stored suite is JSON with sorted keys anyway
    header = ["variant", "val loss (in distribution)"] + [f"{c} loss" for c in corpora]
    base = data.heldout.get(data.baseline.label, {})
    out = []
    for s in data.summaries:
        row = [s.label, _f(s.mean_loss, ".4f")]
        for c in corpora:
            losses = data.heldout.get(s.label, {}).get(c, [])
            if not losses:
                row.append("-")
                continue
            mean = statistics.fmean(losses)
            cell = f"{mean:.4f}" + ("" if len(losses) == len(s.finished) else f" ({len(losses)} seeds)")
            if s.role != "baseline" and base.get(c):
                cell += f" ({mean - statistics.fmean(base[c]):+.4f})"
            row.append(cell)
        out.append(row)
    return header, out


def results_table(data: ReportData) -> tuple[list[str], list[list[str]]]:
    """One row per label; the loss columns up to the verdict, then one column per downstream
    task (mean over seeds, and the variant's difference against the baseline in brackets)."""
    header = ["variant", "seeds", "val loss", "bpb", "Δ loss", "z", "95% CI of Δ", "test",
              "p paired", "p unpaired", "p Bonferroni", "p Holm", "MDE", "verdict"] + [
                  f"{t} {task_metric(t)}" for t in data.tasks]
    out = []
    for s in data.summaries:
        c = s.comparison
        seeds = f"{len(s.finished)}/{s.planned}" + (f" ({s.diverged} diverged)" if s.diverged else "")
        loss = _f(s.mean_loss, ".4f") + (f" ± {s.sd_loss:.4f}" if s.sd_loss is not None else "")
        bpb = _f(statistics.fmean(s.bpbs), ".4f") if s.bpbs else "-"
        tasks = [_task_cell(data, s, t) for t in data.tasks]
        if c is None:
            out.append([s.label, seeds, loss, bpb, "-", "-", "-", "-", "-", "-", "-", "-",
                        _f(mde_of(data, s), ".4f"), s.verdict, *tasks])
            continue
        ci = "-" if c.ci_low is None else f"[{c.ci_low:+.4f}, {c.ci_high:+.4f}]"
        out.append([s.label, seeds, loss, bpb, f"{c.diff:+.4f}", _f(c.z, "+.2f"), ci, c.method.split(" ")[0],
                    _p(c.paired.p if c.paired else None) + (f" (n={c.paired.n})" if c.paired else ""),
                    _p(c.unpaired.p if c.unpaired else None), _p(c.p_adjusted), _p(c.p_holm),
                    _f(c.mde, ".4f"), c.verdict, *tasks])
    return header, out


def downstream_table(data: ReportData) -> tuple[list[str], list[list[str]]]:
    """Per label and task: mean ± standard error (``LabelSummary.task_se``; † marks the
    single-seed, over-items kind), the number of seeds in brackets where it differs from the
    label's finished runs. The header names the metric and the items evaluated per run."""
    header = ["variant", "seeds"]
    for t in data.tasks:
        ns = sorted({d.n for s in data.summaries for d in s.downstream.get(t, [])})
        header.append(f"{t} {task_metric(t)}" + (f" (n={'/'.join(map(str, ns))})" if ns else ""))
    out = []
    for s in data.summaries:
        evaluated = {d.run_id for rows in s.downstream.values() for d in rows}
        row = [s.label, f"{len(evaluated)}/{len(s.finished)}"]
        for t in data.tasks:
            mean = s.task_mean(t)
            se, over_seeds = s.task_se(t)
            if mean is None:
                row.append("-")
                continue
            k = len(s.downstream[t])
            row.append(f"{mean:.4f} ± {_f(se, '.4f')}" + ("" if over_seeds else "†")
                       + ("" if k == len(s.finished) else f" ({k} seeds)"))
        out.append(row)
    return header, out


def _latency_shapes(data: ReportData) -> list[tuple[str, int]]:
    return [("prefill", 1)] + [("decode", b) for b in data.measure["batches"]]


def latency_ratio(data: ReportData, row: LatencyRow) -> tuple[float | None, bool]:
    """(``row``'s ms over the baseline's at the same shape, whether the two come from different
    measuring sessions); no ratio without a baseline figure on the same device, dtype and timer."""
    base = data.baseline.latency.get((row.phase, row.batch))
    if base is None or (base.device, base.dtype, base.timer) != (row.device, row.dtype, row.timer):
        return None, False
    return row.ms / base.ms, base.session != row.session


def _latency_cell(data: ReportData, s: LabelSummary, shape: tuple[str, int]) -> str:
    """ms, the ratio to the baseline for a variant (‡: measured in another session), and the
    length measured at when the model had no room for the suite's."""
    row = s.latency.get(shape)
    if row is None:
        return "-"
    cell = fmt_ms(row.ms)
    if s.role != "baseline":
        ratio, other = latency_ratio(data, row)
        cell += f" ({ratio:.2f}×{'‡' if other else ''})" if ratio is not None else " (other device)"
    if row.length != row.requested:
        cell += f" [{'prompt' if row.phase == 'prefill' else 'ctx'} {row.length}]"
    return cell


def costs_table(data: ReportData) -> tuple[list[str], list[list[str]]]:
    """The computed costs and training throughput; with measured latency, a column per measured
    shape: ms (the variant's ratio to the baseline in brackets)."""
    ctx = data.plan["runs"][0]["cost_context"]
    header = ["variant", "params total", "params active", "train FLOPs/tok", "prefill FLOPs/tok",
              "decode FLOPs/tok", "KV bytes/tok", f"decode bytes/step (ctx {ctx})",
              "train tokens/s (see note)", "runs at once", "tokens/run"]
    shapes = _latency_shapes(data) if data.measured else []
    for phase, batch in shapes:
        header.append(f"prefill ms (prompt {data.measure['prompt']})" if phase == "prefill"
                      else f"decode ms/token b{batch} (ctx {ctx})")
    out = []
    for s in data.summaries:
        c = s.costs
        tokens = {p["tokens"] for p in data.plan["runs"] if p["label"] == s.label}
        out.append([s.label, si(c["params_total"]), si(c["params_active"]),
                    si(c["train_flops_per_token"]), si(c["prefill_flops_per_token"]),
                    si(c["decode_flops_per_token"]), si(c["kv_bytes_per_token"], "B"),
                    si(c["decode_bytes_per_step"], "B"), si(s.tokens_per_s), s.runs_at_once,
                    ", ".join(si(t) for t in sorted(tokens))]
                   + [_latency_cell(data, s, shape) for shape in shapes])
    return header, out


def latency_fact(data: ReportData) -> str:
    """The overview line on measured latency: where it was timed, or why there is none."""
    m = data.measure
    if not data.measured:
        why = {"never": "costs.measure is never",
               "auto": "costs.measure auto measures runs trained on CUDA; always also times CPU runs"}
        return f"Measured latency: none ({why.get(m['measure'], 'no finished run measured yet')})"
    rows = [r for s in data.summaries for r in s.latency.values()]
    where = sorted({latency_device_text(r) for r in rows})
    sessions = len({r.session for r in rows})
    return (f"Measured latency: {'; '.join(where)}; final checkpoint of one run per variant, "
            f"{plural(sessions, 'measuring session')}")


def latency_note(data: ReportData) -> str:
    """How the measured columns were taken, and every shape measured smaller than asked."""
    m = data.measure
    ctx = data.plan["runs"][0]["cost_context"]
    rows = [r for s in data.summaries for r in s.latency.values()]
    cuda = any(r.timer == "cuda-events" for r in rows)
    text = (f"Measured latency: the inference engine of archlab serve (archlab.infer.bench) on the final "
            f"checkpoint of one run per variant (its first finished seed: latency does not depend on the seed), "
            f"timed after training in the suite's own process, one variant after another while no other archlab "
            f"run trained on the host. Prefill ms: a {m['prompt']}-token prompt at batch 1 until its first "
            f"token is chosen. Decode ms/token bN: one decode step of N sequences (one new token each) with "
            f"{ctx} tokens in the cache. Medians "
            + ("of CUDA-event timings after warm-up" if cuda else "")
            + (" and " if cuda and not all(r.timer == "cuda-events" for r in rows) else "")
            + ("of CPU wall-clock timings after warm-up (not comparable with GPU figures)"
               if any(r.timer == "wall-clock" for r in rows) else "")
            + ". In round brackets: the variant over the baseline at the same shape, device and dtype "
              "(‡: measured in another session than the baseline's, so not in the same run).")
    fitted: dict[str, list[str]] = {}
    for s in data.summaries:
        for r in s.latency.values():
            if r.length != r.requested:
                what = "prompt" if r.phase == "prefill" else f"decode b{r.batch} context"
                fit = f"{what} {r.length} of {r.requested} (max_seq_len {r.max_seq_len})"
                fitted.setdefault(fit, []).append(s.label)
    if fitted:
        text += (" Measured at a smaller shape than asked, the most the model has room for (in square "
                 "brackets): " + "; ".join(f"{fit}: {', '.join(labels)}" for fit, labels in fitted.items()) + ".")
    return text


def overview(data: ReportData) -> list[str]:
    """Short facts about the suite: budget, seeds, noise floor, progress, provenance."""
    s = data.suite
    done = sum(len(x.finished) for x in data.summaries)
    planned = sum(x.planned for x in data.summaries)
    running = sum(x.running for x in data.summaries)
    interrupted = sum(x.interrupted for x in data.summaries)
    diverged = sum(x.diverged for x in data.summaries)
    revisions = sorted({r.code_revision for r in data.rows})
    floor = (f"{data.floor:.4f} (sample std of the baseline's {len(data.baseline.losses)} final losses)"
             if data.floor is not None else "not available (needs at least 2 finished baseline seeds)")
    seeds = s["seeds"]
    return [
        f"Suite: {s['name']} ({s['origin']}), preset {s['preset'] or 'none'}"
        + (f", overrides: {' '.join(data.plan['overrides'])}" if data.plan["overrides"] else ""),
        f"Budget: {s['budget']['tokens']:,} tokens, {s['budget']['match']} matching"
        + "".join(f"; {label}: {m}" for label, m in sorted(s["budget"].get("variant_match", {}).items())),
        f"Seeds: baseline init {seeds['baseline']}, variants init {seeds['variants']}, data order "
        + ("= init seed" if seeds["data"] == "init" else f"seed {seeds['data']} for every run")
        + ("; variants paired with the baseline by seed" if all(paired_design(data, x.label)
                                                               for x in data.summaries[1:]) and data.summaries[1:]
           else ""),
        f"Runs: {done} of {planned} finished" + (f", {running} running" if running else "")
        + (f", {interrupted} interrupted (the process training {'it' if interrupted == 1 else 'them'} "
           "is gone; compare resumes from the last checkpoint)" if interrupted else "")
        + (f", {diverged} diverged" if diverged else ""),
        f"Noise floor: {floor}" + ("" if seeds["data"] == "init" or data.floor is None else
                                   "; init seeds only (one data order for every run: data-order noise "
                                   "is not in it, seeds.data: init puts it there)"),
        f"Final loss = mean of the last {plural(s['eval']['last_k'], 'evaluation')}; {verdict_rule(data)}",
        mde_fact(data),
        compute_fact(data),
    ] + [f"Stop rule broken: {c['what']} after {plural(c['finished'], 'run')} had finished ({c['at']}): "
         f"{INVALID}" for c in data.seed_changes] + [
        f"Code revision: {', '.join(revisions) or '-'}",
        devices_fact(data.rows),
        latency_fact(data),
    ] + ([_downstream_fact(data)] if data.tasks else [])


def verdict_rule(data: ReportData) -> str:
    """The rule a verdict follows, in one sentence."""
    other = "Holm" if data.adjust == "bonferroni" else "Bonferroni"
    name = "Bonferroni" if data.adjust == "bonferroni" else "Holm"
    return (f"verdict: the paired t-test when a variant's finished seeds pair completely with the "
            f"baseline's (at least 2 pairs), else Welch's; {name}-adjusted p over "
            f"{plural(data.n_tests, 'variant')} < alpha = {data.alpha} decides ({other} shown too)")


def mde_fact(data: ReportData) -> str:
    """The smallest difference the suite's seeds can detect (unpaired, from the noise floor)."""
    if data.floor is None:
        return "Minimum detectable effect: not available (needs the noise floor)"
    n_var = sorted({x.planned for x in data.summaries[1:]}) or [0]
    parts = []
    for nv in n_var:
        mde = mde_unpaired(data.floor, data.baseline.planned, nv, data.alpha / data.n_tests)
        if mde is not None:
            parts.append(f"{mde:.4f} ({mde / data.floor:.1f} noise floors) with {data.baseline.planned} "
                         f"baseline and {nv} variant seeds")
    return (f"Minimum detectable effect (power {POWER:g}, two-sided alpha / {data.n_tests}, unpaired, from "
            f"the noise floor): " + ("; ".join(parts) or "-")
            + "; the MDE column gives each variant's, from its deciding test")


def compute_fact(data: ReportData) -> str:
    """Suite wall time (summed over runs, and first start to last finish) and GPU-hours."""
    wall, hours = compute_hours(data.rows)
    ended = [r.finished_at for r in data.rows if r.finished_at is not None]
    span = (f"; {duration(max(ended) - min(r.started_at for r in data.rows))} from the first start to the "
            "last finish" if ended else "")
    return f"Compute: {duration(wall)} of run wall time, {hours:.3f} GPU-hours{span}"


def devices_fact(rows: list[RunRow]) -> str:
    """What trained the runs: each distinct device with its number of runs."""
    counts = Counter(device_text(r.device) for r in rows if r.device)
    if not counts:
        return "Device: -"
    parts = [f"{d} ({plural(n, 'run')})" for d, n in sorted(counts.items())]
    return f"Device{'s' if len(parts) > 1 else ''}: {'; '.join(parts)}"


def _downstream_fact(data: ReportData) -> str:
    limit = data.suite["eval"].get("limit")
    finished = sum(len(x.finished) for x in data.summaries)
    evaluated = len({d.run_id for x in data.summaries for rows in x.downstream.values() for d in rows})
    return (f"Downstream (zero-shot, final checkpoints): {', '.join(data.tasks)}; "
            + (f"first {limit} items per task" if limit else "every item")
            + f"; {evaluated} of {finished} finished runs evaluated")


METHOD_NOTE = (
    "Δ = mean(variant) - mean(baseline) of the final validation loss (negative is better); "
    "z = Δ / noise floor. Runs with the same init and data seeds are pairs. p paired: the paired "
    "t-test on the per-pair differences (n = pairs); p unpaired: Welch's t-test when both sides have "
    "at least 2 seeds, with a single seed on one side the pooled two-sample t-test (the "
    "prediction-interval test of one observation against a sample, assuming equal seed noise). "
    "Test: the one that decides, paired when the variant's finished seeds and the baseline's pair "
    "completely (at least 2 pairs), else unpaired; the 95% CI is the deciding test's and is not "
    "adjusted. p Bonferroni = min(1, p × number of variants); p Holm: Holm's step-down adjustment "
    "(a variant without a p yet counts as the largest). The suite's eval.adjust names the one that "
    "decides: a variant is better or worse only if it is below alpha. MDE: the smallest true "
    "difference the deciding test detects with power 0.8 at two-sided alpha / number of variants, "
    "for the planned seeds (unpaired: from the noise floor; paired: from the sd of the variant's "
    "differences). Seeds are fixed in the suite file before the runs; a plan changed after results "
    "voids the verdicts (see the overview)."
)


COSTS_NOTE = (
    "Train tokens/s: end-to-end training throughput of one run (its tokens over its wall time, "
    "evaluations and checkpoints included), median over the variant's finished seeds. It depends "
    "on what else the machine was doing: runs at once is the most runs this host was training at "
    "the same time while a run trained (compare --jobs, other compares sharing the host; sampled, "
    "- where not recorded), so rates measured under a different load or on another device (see "
    "the device line) are not comparable. The FLOP and byte columns are computed, not measured."
)


DOWNSTREAM_NOTE = (
    "Zero-shot accuracy of each run's final checkpoint: acc_norm (the choice with the highest "
    "log-likelihood per byte) for multiple-choice tasks, acc (last word greedily right) for LAMBADA. "
    "Mean over seeds ± its standard error over seeds (sample standard deviation / √seeds); † a "
    "single seed: the binomial standard error over the task's items instead. The results table "
    "gives the variant's difference against the baseline's mean in brackets. No significance test "
    "is made on these; the verdict rests on the validation loss."
)


HELDOUT_NOTE = (
    "Validation loss (nats/token) of each run's final checkpoint on the validation split of each "
    "extra corpus named in the suite's eval_data (prepared with the suite's tokenizer), next to the "
    "in-distribution loss; mean over seeds, a variant's difference against the baseline in brackets. "
    "No significance test is made on these."
)


COMPUTE_NOTE = (
    "Wall time: each run's training wall time as the trainer reports it, summed. GPU-hours: that "
    "wall time for runs on a GPU (one device per run; runs that shared a GPU, see runs at once, are "
    "each counted in full, so this is an upper bound); CPU runs count none. A verdict's cost is the "
    "variant's runs plus the baseline's."
)


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


# ---- outputs ----------------------------------------------------------------------------------
def _md_table(header: list[str], rows: list[list[str]]) -> str:
    esc = [[c.replace("|", "\\|") for c in r] for r in [header, *rows]]
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(lines)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1150px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:14px}th,td{border:1px solid #ccc;padding:4px 8px}
th{background:#f3f3f3}td{text-align:right}td:first-child,td:last-child{text-align:left}
figure{margin:1.5em 0}img{max-width:100%}figcaption{color:#555;font-size:14px}"""


def _write_atomic(path: Path, data: bytes) -> None:
    """Write through a temporary file and a rename: compares sharing a suite directory may write
    its report at the same moment, and a reader must see one whole report, not two interleaved."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_report(out_dir: str | Path) -> tuple[Path, Path]:
    """Write report.md (+ PNGs) and report.html into the suite directory ``out_dir``."""
    out = Path(out_dir)
    with ResultStore(out / DB_NAME, create=False) as store:
        data = collect(store)
    title = f"archlab comparison: {data.suite['name']}"
    tables = [("Results", *results_table(data)), ("Costs", *costs_table(data))]
    if data.tasks:
        tables.append(("Downstream", *downstream_table(data)))
    if data.suite.get("eval_data"):
        tables.append(("Held-out corpora", *heldout_table(data)))
    tables.append(("Compute", *compute_table(data)))
    figures = list(FIGURES) + ([LATENCY_FIGURE] if data.measured else [])
    makers = (fig_curves, fig_diffs, fig_tradeoff, fig_latency)
    pngs = {name: _png(fn(data)) for (name, _), fn in zip(figures, makers)}
    for name, blob in pngs.items():
        _write_atomic(out / name, blob)
    facts = overview(data)
    desc = data.suite["description"]

    notes = {"Costs": [COSTS_NOTE] + ([latency_note(data)] if data.measured else []),
             "Downstream": [DOWNSTREAM_NOTE], "Held-out corpora": [HELDOUT_NOTE], "Compute": [COMPUTE_NOTE]}
    md = [f"# {title}", ""] + ([desc, ""] if desc else []) + [f"- {f}" for f in facts] + [""]
    for name, header, rows in tables:
        md += [f"## {name}", "", _md_table(header, rows), ""]
        for note in notes.get(name, []):
            md += [note, ""]
    md += [METHOD_NOTE, "", "## Figures", ""]
    for name, caption in figures:
        md += [f"![{name[:-4].replace('_', ' ')}]({name})", "", f"*{caption}*", ""]
    md_path = out / "report.md"
    _write_atomic(md_path, "\n".join(md).encode())

    body = [f"<h1>{html.escape(title)}</h1>"] + ([f"<p>{html.escape(desc)}</p>"] if desc else [])
    body.append("<ul>" + "".join(f"<li>{html.escape(f)}</li>" for f in facts) + "</ul>")
    for name, header, rows in tables:
        body += [f"<h2>{name}</h2>", _html_table(header, rows)]
        for note in notes.get(name, []):
            body.append(f"<p>{html.escape(note)}</p>")
    body += [f"<p>{html.escape(METHOD_NOTE)}</p>", "<h2>Figures</h2>"]
    for name, caption in figures:
        b64 = base64.b64encode(pngs[name]).decode()
        body.append(f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{b64}">'
                    f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    html_path = out / "report.html"
    _write_atomic(html_path, page.encode("utf-8"))
    return md_path, html_path


def print_report(out_dir: str | Path, console: Console) -> None:
    """The results table (and the suite facts) on the console."""
    with ResultStore(Path(out_dir) / DB_NAME, create=False) as store:
        data = collect(store)
    for fact in overview(data):
        console.print(fact, highlight=False)
    full_header, full_rows = results_table(data)
    # The console gets the columns a verdict rests on; bpb, test and raw p are in the files.
    keep = [i for i, h in enumerate(full_header) if h not in ("bpb", "test", "p paired", "p unpaired")]
    header = [full_header[i] for i in keep]
    rows = [[r[i] for i in keep] for r in full_rows]
    table = Table(title=f"suite {data.suite['name']}: final validation loss against {data.baseline.label}",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    verdict = header.index("verdict")  # the downstream task columns, if any, follow it
    for i, h in enumerate(header):
        # in a narrow terminal the verdict, the intervals and the task names wrap
        table.add_column(h, justify="left" if i in (0, verdict) else "right",
                         no_wrap=h not in ("verdict", "val loss", "95% CI of Δ") and i < verdict)
    styles = {"better": "green", "worse": "red"}
    for r in rows:
        table.add_row(*r, style=styles.get(r[verdict]))
    console.print(table)
