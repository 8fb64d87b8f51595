"""Reports of a suite, built from its results database alone: this module renders them (the
Markdown and HTML files with their figures, ``write_report``; the console table,
``print_report``). What they show is gathered by ``archlab.lab.report.data``, laid out in tables
by ``archlab.lab.report.tables`` and put in words by ``archlab.lab.report.text``; their names
are re-exported by the package, so ``archlab.lab.report`` stays the one import path.

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
import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich import box
from rich.console import Console
from rich.table import Table

from archlab.lab.report.figures import fig_curves, fig_diffs, fig_effect_by_length, fig_latency, fig_tradeoff
from archlab.lab.fmt import device_text, si
from archlab.lab.report.data import LabelSummary, ReportData, collect, collect_budgets
from archlab.lab.report.tables import (compute_hours, compute_table, costs_table, downstream_table,
                                       downstream_verdicts_table, heldout_table, latency_ratio, mde_of,
                                       paired_design, planned_seeds, results_table, task_metric)
from archlab.lab.report.text import (COMPUTE_NOTE, COSTS_NOTE, DOWNSTREAM_NOTE, DOWNSTREAM_VERDICTS_NOTE, HELDOUT_NOTE,
                                     METHOD_NOTE, budget_facts, compute_fact, devices_fact, final_fact, latency_fact,
                                     latency_note, mde_fact, overview, schedule_fact, suite_overview, verdict_rule)
from archlab.lab.report.trend import markdown as trend_markdown
from archlab.lab.report.trend import trend, trend_table
from archlab.errors import ArchlabError
from archlab.io.files import naming
from archlab.io.temporaries import temporary_path
from archlab.lab.store import DB_NAME, ResultStore

__all__ = [
    "COMPUTE_NOTE", "COSTS_NOTE", "DOWNSTREAM_NOTE", "DOWNSTREAM_VERDICTS_NOTE", "FIGURES", "HELDOUT_NOTE",
    "LATENCY_FIGURE", "LENGTH_FIGURE", "METHOD_NOTE", "LabelSummary", "ReportData", "collect", "collect_budgets",
    "compute_fact", "compute_hours", "compute_table", "costs_table", "device_text", "devices_fact",
    "downstream_table", "downstream_verdicts_table", "fig_curves", "fig_diffs", "fig_effect_by_length",
    "fig_latency", "fig_tradeoff", "final_fact", "heldout_table", "latency_fact", "latency_note", "latency_ratio",
    "mde_fact", "mde_of", "overview", "paired_design", "planned_seeds", "print_report", "results_table",
    "budget_facts", "schedule_fact", "suite_overview", "task_metric", "verdict_rule", "write_report",
]

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
# Added for a suite with several token budgets (the figures above then show the longest budget).
LENGTH_FIGURE = ("effect_by_length.png",
                 "Each variant's effect on the final validation loss (variant - baseline, negative is better) "
                 "with its 95% confidence interval, at every token budget of the suite (each budget's runs "
                 "trained from scratch with their own schedule); the legend gives the trend's verdict.")



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
    its report at the same moment, and a reader must see one whole report, not two interleaved.
    A failed write leaves no temporary behind and its error names ``path``."""
    tmp = temporary_path(path, "tmp")
    try:
        with naming(tmp):
            tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _tables(data: ReportData) -> list[tuple[str, list[str], list[list[str]]]]:
    """The tables of one budget, titled."""
    tables = [("Results", *results_table(data)), ("Costs", *costs_table(data))]
    if data.downstream_verdicts is not None:
        tables.append(("Downstream verdicts", *downstream_verdicts_table(data)))
    if data.tasks:
        tables.append(("Downstream", *downstream_table(data)))
    if data.suite.get("eval_data"):
        tables.append(("Held-out corpora", *heldout_table(data)))
    tables.append(("Compute", *compute_table(data)))
    return tables


def write_report(out_dir: str | Path) -> tuple[Path, Path]:
    """Write report.md (+ PNGs) and report.html into the suite directory ``out_dir``. A suite with
    several token budgets gets a section per budget and the effects against training length; its
    figures of curves and costs show the longest budget."""
    out = Path(out_dir)
    with ResultStore(out / DB_NAME, create=False) as store:
        parts = collect_budgets(store)
    data = parts[-1]
    title = f"archlab comparison: {data.suite['name']}"
    figures = list(FIGURES) + ([LATENCY_FIGURE] if data.measured else [])
    makers = [fig_curves, fig_diffs, fig_tradeoff] + ([fig_latency] if data.measured else [])
    pngs = {name: _png(fn(data)) for (name, _), fn in zip(figures, makers)}
    trend_rows = None
    if len(parts) > 1:
        try:
            trend_rows = trend(parts)
        except ArchlabError:  # no variant label yet (a suite of the baseline alone)
            trend_rows = []
        figures.append(LENGTH_FIGURE)
        pngs[LENGTH_FIGURE[0]] = _png(fig_effect_by_length(trend_rows))
    for name, blob in pngs.items():
        _write_atomic(out / name, blob)
    facts = suite_overview(parts)
    desc = data.suite["description"]
    notes = {"Costs": [COSTS_NOTE] + ([latency_note(data)] if data.measured else []),
             "Downstream verdicts": [DOWNSTREAM_VERDICTS_NOTE], "Downstream": [DOWNSTREAM_NOTE],
             "Held-out corpora": [HELDOUT_NOTE], "Compute": [COMPUTE_NOTE]}
    # (heading, level, facts, tables) per section: one section per budget of a multi-budget suite
    sections = ([(None, [], _tables(data))] if len(parts) == 1 else
                [(f"Budget {si(p.budget)} tokens", budget_facts(p), _tables(p)) for p in parts])

    md = [f"# {title}", ""] + ([desc, ""] if desc else []) + [f"- {f}" for f in facts] + [""]
    body = [f"<h1>{html.escape(title)}</h1>"] + ([f"<p>{html.escape(desc)}</p>"] if desc else [])
    body.append("<ul>" + "".join(f"<li>{html.escape(f)}</li>" for f in facts) + "</ul>")
    if trend_rows is not None:
        md += ["## Effect against training length", "", trend_markdown(trend_rows) if trend_rows else "-", ""]
        if trend_rows:
            header, rows = _trend_rows(trend_rows)
            body += ["<h2>Effect against training length</h2>", _html_table(header, rows)]
    for heading, section_facts, tables in sections:
        level = "##" if heading is None else "###"
        if heading is not None:
            md += [f"## {heading}", ""] + [f"- {f}" for f in section_facts] + [""]
            body += [f"<h2>{html.escape(heading)}</h2>",
                     "<ul>" + "".join(f"<li>{html.escape(f)}</li>" for f in section_facts) + "</ul>"]
        for name, header, rows in tables:
            md += [f"{level} {name}", "", _md_table(header, rows), ""]
            body += [f"<h{len(level)}>{name}</h{len(level)}>", _html_table(header, rows)]
            for note in notes.get(name, []):
                md += [note, ""]
                body.append(f"<p>{html.escape(note)}</p>")
    md += [METHOD_NOTE, "", "## Figures", ""]
    body += [f"<p>{html.escape(METHOD_NOTE)}</p>", "<h2>Figures</h2>"]
    for name, caption in figures:
        md += [f"![{name[:-4].replace('_', ' ')}]({name})", "", f"*{caption}*", ""]
        b64 = base64.b64encode(pngs[name]).decode()
        body.append(f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{b64}">'
                    f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    md_path = out / "report.md"
    _write_atomic(md_path, "\n".join(md).encode())
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    html_path = out / "report.html"
    _write_atomic(html_path, page.encode("utf-8"))
    return md_path, html_path


def _trend_rows(rows: list) -> tuple[list[str], list[list[str]]]:
    """The trend's Markdown table as (header, rows), for the HTML page."""
    lines = trend_markdown(rows).splitlines()
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]
    return cells[0], cells[2:]


def print_report(out_dir: str | Path, console: Console) -> None:
    """The results table (and the suite facts) on the console: one table per budget of a suite
    with several, then its effects against training length."""
    with ResultStore(Path(out_dir) / DB_NAME, create=False) as store:
        parts = collect_budgets(store)
    for fact in suite_overview(parts):
        console.print(fact, highlight=False)
    for data in parts:
        _print_results(data, console)
    if len(parts) > 1:
        try:
            console.print(trend_table(trend(parts)))
        except ArchlabError as e:  # no variant yet
            console.print(f"effect against training length: {e}", highlight=False)


def _print_results(data: ReportData, console: Console) -> None:
    full_header, full_rows = results_table(data)
    # The console gets the columns a verdict rests on; bpb, test and raw p are in the files.
    keep = [i for i, h in enumerate(full_header) if h not in ("bpb", "test", "p paired", "p unpaired")]
    header = [full_header[i] for i in keep]
    rows = [[r[i] for i in keep] for r in full_rows]
    at = f" at {si(data.budget)} tokens" if data.multi_budget else ""
    table = Table(title=f"suite {data.suite['name']}{at}: final validation loss against {data.baseline.label}",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    verdict = header.index("verdict")  # the downstream verdict and task columns, if any, follow it
    for i, h in enumerate(header):
        # in a narrow terminal the verdict, the intervals and the task names wrap
        table.add_column(h, justify="left" if i in (0, verdict) else "right",
                         no_wrap=h not in ("verdict", "val loss", "95% CI of Δ") and i < verdict)
    styles = {"better": "green", "worse": "red"}
    for r in rows:
        table.add_row(*r, style=styles.get(r[verdict]))
    console.print(table)
