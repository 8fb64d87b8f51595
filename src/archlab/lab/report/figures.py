"""The report's figures (matplotlib, no display): loss curves with seed bands, differences
against the baseline with confidence intervals, and quality against computed and measured cost."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.figure import Figure

from archlab.lab.fmt import latency_device_text, plural

if TYPE_CHECKING:
    from archlab.lab.report.data import ReportData
    from archlab.lab.store import RunRow


def _colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return ["black"] + [cmap(i % 10) for i in range(n - 1)]


def _curve_band(runs: list[RunRow]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(tokens, mean, min, max) over the evaluation points every seed has."""
    curves = [{int(p["tokens"]): float(p["loss"]) for p in r.val_curve} for r in runs if r.val_curve]
    if not curves:
        return None
    common = sorted(set.intersection(*(set(c) for c in curves)))
    if not common:
        return None
    y = np.array([[c[t] for t in common] for c in curves])
    return np.array(common, dtype=float), y.mean(0), y.min(0), y.max(0)


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _quality_points(ax: Any, shown: list[tuple[Any, Any, float]], xlabel: str) -> None:
    """Each variant's final loss (mean, seed std as error bar) against a cost ``x``, labelled;
    the baseline as a square."""
    for s, color, x in shown:
        ax.errorbar([x], [s.mean_loss], yerr=[s.sd_loss or 0.0], fmt="s" if s.role == "baseline" else "o",
                    color=color, capsize=3)
        ax.annotate(s.label, (x, s.mean_loss), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    ax.margins(x=0.15, y=0.15)


def fig_curves(data: ReportData) -> Figure:
    """Against tokens, or against training FLOPs under iso-FLOP matching (where the variants'
    token counts differ by design and compute is what was held equal)."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    full, tail = fig.subplots(1, 2)
    # Against FLOPs only when every label was matched by FLOPs; a suite mixing both plots tokens.
    iso_flop = data.suite["budget"]["match"] == "iso-flop" and not any(
        m != "iso-flop" for m in data.suite["budget"].get("variant_match", {}).values())
    plotted = False
    for s, color in zip(data.summaries, _colors(len(data.summaries))):
        band = _curve_band(s.finished)
        if band is None:
            continue
        x, mean, lo, hi = band
        if iso_flop:
            x = x * float(s.costs["train_flops_per_token"])
        plotted = True
        keep = x >= x[-1] / 2
        for ax, m in ((full, np.ones_like(keep)), (tail, keep)):
            ax.plot(x[m], mean[m], color=color, lw=1.6, label=f"{s.label} ({plural(len(s.finished), 'seed')})")
            ax.fill_between(x[m], lo[m], hi[m], color=color, alpha=0.18, lw=0)
    if not plotted:
        _empty(full, "no finished runs yet")
        _empty(tail, "")
        return fig
    for ax, title in ((full, "validation loss"), (tail, "last half of training")):
        ax.set_xlabel("training FLOPs" if iso_flop else "training tokens")
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    tail.legend(fontsize=8)
    return fig


def fig_diffs(data: ReportData) -> Figure:
    comps = [(s.label, s.comparison) for s in data.summaries[1:] if s.comparison is not None]
    fig = Figure(figsize=(8, 1.2 + 0.5 * max(1, len(comps))), layout="constrained")
    ax = fig.subplots()
    if not comps:
        _empty(ax, "no variant with a finished run and a baseline yet")
        return fig
    if data.floor:
        ax.axvspan(-2 * data.floor, 2 * data.floor, color="grey", alpha=0.12, lw=0, label="±2 noise floors")
        ax.axvspan(-data.floor, data.floor, color="grey", alpha=0.25, lw=0, label="±1 noise floor")
    ax.axvline(0.0, color="black", lw=0.8)
    colors = _colors(len(data.summaries))[1:]
    for i, ((label, c), color) in enumerate(zip(comps, colors)):
        if c.ci_low is not None and c.ci_high is not None:
            ax.errorbar([c.diff], [i], xerr=[[c.diff - c.ci_low], [c.ci_high - c.diff]], fmt="o",
                        color=color, capsize=4)
        else:
            ax.plot([c.diff], [i], "o", color=color, mfc="none")
    ax.set_yticks(range(len(comps)), [f"{lbl}\n{c.verdict}" for lbl, c in comps], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("Δ final validation loss vs baseline (negative = better), 95% CI")
    ax.grid(axis="x", alpha=0.3)
    if data.floor:
        ax.legend(fontsize=8, loc="best")
    return fig


def fig_tradeoff(data: ReportData) -> Figure:
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    points = [(s, color) for s, color in zip(data.summaries, _colors(len(data.summaries)))
              if s.mean_loss is not None]
    if not points:
        for ax in axes:
            _empty(ax, "no finished runs yet")
        return fig
    ctx = data.plan["runs"][0]["cost_context"]
    for ax, key, xlabel in ((axes[0], "prefill_flops_per_token", "prefill FLOPs per token"),
                            (axes[1], "decode_bytes_per_step", f"bytes read per decode step (context {ctx})")):
        _quality_points(ax, [(s, color, float(s.costs[key])) for s, color in points], xlabel)
    axes[0].set_ylabel("final validation loss")
    fig.suptitle("quality against prefill cost and decode cost")
    return fig


def fig_latency(data: ReportData) -> Figure:
    """Quality against decode cost computed (bytes per step) next to measured (ms per step at
    batch 1, or the smallest batch measured), and against measured prefill latency."""
    fig = Figure(figsize=(14, 4.2), layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    batch = 1 if 1 in data.measure["batches"] else min(data.measure["batches"])
    ctx = data.plan["runs"][0]["cost_context"]
    points = [(s, color) for s, color in zip(data.summaries, _colors(len(data.summaries)))
              if s.mean_loss is not None]
    rows = [r for s in data.summaries for r in s.latency.values()]
    where = "; ".join(sorted({latency_device_text(r) for r in rows}))
    panels = ((axes[0], lambda s: float(s.costs["decode_bytes_per_step"]),
               f"bytes read per decode step (context {ctx}), computed"),
              (axes[1], lambda s: s.latency[("decode", batch)].ms if ("decode", batch) in s.latency else None,
               f"decode ms per token, batch {batch} (context {ctx}), measured"),
              (axes[2], lambda s: s.latency[("prefill", 1)].ms if ("prefill", 1) in s.latency else None,
               f"prefill ms, prompt {data.measure['prompt']}, measured"))
    short = {(r.phase, r.batch) for r in rows if r.length != r.requested}
    for (ax, value, xlabel), shape in zip(panels, (None, ("decode", batch), ("prefill", 1))):
        if shape in short:
            xlabel += "\n(some shortened to fit the model: see the costs note)"
        shown = [(s, color, value(s)) for s, color in points if value(s) is not None]
        if not shown:
            _empty(ax, "nothing measured yet")
            ax.set_xlabel(xlabel)
            continue
        _quality_points(ax, shown, xlabel)
    axes[0].set_ylabel("final validation loss")
    fig.suptitle(f"quality against decode cost, computed and measured, and measured prefill cost ({where})",
                 fontsize=10)
    return fig


def fig_effect_by_length(rows: list[Any]) -> Figure:
    """Each variant's effect (variant - baseline, final loss) with its 95% CI against the token
    budget of a multi-budget suite (``archlab.lab.report.trend`` rows), log-scaled tokens."""
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    ax = fig.subplots()
    if not rows:
        _empty(ax, "no variant shared by every budget")
        return fig
    ax.axhline(0.0, color="black", lw=0.8)
    for i, (r, color) in enumerate(zip(rows, _colors(len(rows) + 1)[1:])):
        pts = [p for p in r.points if p.effect is not None and p.tokens]
        if not pts:
            continue
        shift = 1.0 + 0.015 * (i - len(rows) / 2)  # side by side at each budget, not on top of each other
        x = np.array([p.tokens * shift for p in pts], dtype=float)
        y = np.array([p.effect for p in pts])
        lo = np.array([p.effect - p.ci[0] if p.ci else 0.0 for p in pts])
        hi = np.array([p.ci[1] - p.effect if p.ci else 0.0 for p in pts])
        ax.errorbar(x, y, yerr=[lo, hi], fmt="o-", color=color, capsize=3, lw=1.2, label=f"{r.label} ({r.verdict})")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens of the baseline run (budget)")
    ax.set_ylabel("Δ final validation loss (negative is better)")
    ax.grid(alpha=0.3, which="both")
    # Beside the axes, not on them: any corner of the axes can hold a budget's point.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return fig
