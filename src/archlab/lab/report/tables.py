"""The report's tables, each as (header, rows) of strings for Markdown, HTML or the console:
results (losses, tests and verdicts, downstream task means), costs (computed costs, throughput
and measured latency), downstream, held-out corpora and compute; and the cell formatting and
per-variant figures (minimum detectable effect, seed design, compute hours) they share with the
overview (``archlab.lab.report.text``).
"""

from __future__ import annotations

import math
import statistics

from archlab.lab.fmt import device_hours, duration, si
from archlab.lab.latency import fmt_ms
from archlab.lab.report.data import LabelSummary, ReportData
from archlab.lab.stats import Comparison, mde_unpaired
from archlab.lab.store import LatencyRow, RunRow


# ---- formatting -------------------------------------------------------------------------------
def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def _p(p: float | None) -> str:
    if p is None:
        return "-"
    return f"{p:.1e}" if p < 1e-3 else f"{p:.3f}"


def task_metric(task: str, data: ReportData | None = None) -> str:
    """The headline metric of a downstream task: what its stored results are (acc for a task scored
    by exact match, such as LAMBADA or the two-hop queries; acc_norm for multiple choice), or by
    name before any result exists."""
    if data is not None:
        for s in data.summaries:
            for d in s.downstream.get(task, []):
                return d.metric
    return "acc" if task == "lambada" or task.startswith("twohop") else "acc_norm"


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


def _test_cell(c: Comparison) -> str:
    """The deciding test; a paired one with the number of seed pairs it decided on."""
    return f"paired ({c.n_pairs} pairs)" if c.method == "paired" else c.method.split(" ")[0]


def _family_verdict_cell(c: Comparison | None) -> str:
    """A variant's downstream verdict on one family: the difference in the family's mean score
    (positive is better) and the verdict."""
    if c is None:
        return "-"
    return f"{c.diff:+.4f} ({c.verdict})"


def results_table(data: ReportData) -> tuple[list[str], list[list[str]]]:
    """One row per label; the loss columns up to the verdict, then one downstream verdict column
    per task family (``archlab.lab.report.downstream``), then one column per downstream task
    (mean over seeds, and the variant's difference against the baseline in brackets)."""
    families = data.downstream_verdicts.families if data.downstream_verdicts is not None else []
    header = ["variant", "seeds", "val loss", "bpb", "Δ loss", "z", "95% CI of Δ", "test",
              "p paired", "p unpaired", "p Bonferroni", "p Holm", "MDE", "verdict"] + [
                  f"{f.family} verdict" for f in families] + [f"{t} {task_metric(t, data)}" for t in data.tasks]
    out = []
    for s in data.summaries:
        c = s.comparison
        seeds = f"{len(s.finished)}/{s.planned}" + (f" ({s.diverged} diverged)" if s.diverged else "")
        loss = _f(s.mean_loss, ".4f") + (f" ± {s.sd_loss:.4f}" if s.sd_loss is not None else "")
        bpb = _f(statistics.fmean(s.bpbs), ".4f") if s.bpbs else "-"
        tasks = [_task_cell(data, s, t) for t in data.tasks]
        fams = [("baseline" if s.role == "baseline" else _family_verdict_cell(f.comparisons.get(s.label)))
                for f in families]
        if c is None:
            out.append([s.label, seeds, loss, bpb, "-", "-", "-", "-", "-", "-", "-", "-",
                        _f(mde_of(data, s), ".4f"), s.verdict, *fams, *tasks])
            continue
        ci = "-" if c.ci_low is None else f"[{c.ci_low:+.4f}, {c.ci_high:+.4f}]"
        out.append([s.label, seeds, loss, bpb, f"{c.diff:+.4f}", _f(c.z, "+.2f"), ci, _test_cell(c),
                    _p(c.paired.p if c.paired else None) + (f" (n={c.paired.n})" if c.paired else ""),
                    _p(c.unpaired.p if c.unpaired else None), _p(c.p_adjusted), _p(c.p_holm),
                    _f(c.mde, ".4f"), c.verdict, *fams, *tasks])
    return header, out


def downstream_verdicts_table(data: ReportData) -> tuple[list[str], list[list[str]]]:
    """Per variant and task family: Δ of the family's mean score (variant - baseline, positive is
    better) with its 95% CI, the deciding test, Holm's p over variants x families and the verdict.
    The header names each family's tasks, chance level and the baseline's mean ± its error."""
    dv = data.downstream_verdicts
    header = ["variant"]
    for f in dv.families:
        base = ("-" if f.baseline_mean is None
                else f"{f.baseline_mean:.4f} ± {_f(f.baseline_se, '.4f')}")
        header.append(f"{f.family} ({', '.join(f.tasks)}; chance {_f(f.chance, '.3f')}; baseline {base})")
    out = []
    for s in data.summaries[1:]:
        row = [s.label]
        for f in dv.families:
            c = f.comparisons.get(s.label)
            if c is None:
                row.append("-")
                continue
            ci = "" if c.ci_low is None else f" [{c.ci_low:+.4f}, {c.ci_high:+.4f}]"
            test = "-" if c.p is None else f"{_test_cell(c)}, p Holm {_p(c.p_holm)}"
            row.append(f"{c.diff:+.4f}{ci}; {test}; {c.verdict}")
        out.append(row)
    return header, out


def downstream_table(data: ReportData) -> tuple[list[str], list[list[str]]]:
    """Per label and task: mean ± standard error (``LabelSummary.task_se``; † marks the
    single-seed, over-items kind), the number of seeds in brackets where it differs from the
    label's finished runs. The header names the metric and the items evaluated per run."""
    header = ["variant", "seeds"]
    for t in data.tasks:
        ns = sorted({d.n for s in data.summaries for d in s.downstream.get(t, [])})
        header.append(f"{t} {task_metric(t, data)}" + (f" (n={'/'.join(map(str, ns))})" if ns else ""))
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
