"""What ``archlab compare`` shows while it works: the progress display (per-run bars with their
fields, the suite bar's ETA) and the ``--dry-run`` plan table with time estimates."""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TaskID,
                           TextColumn, TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

from archlab.lab.fmt import clock, duration, si
from archlab.lab.plan import Plan, PlannedRun
from archlab.lab.store import RunRow, display_status

RUNS_DIR = "runs"  # a suite directory's run directories, one per run id


def is_done(row: RunRow | None) -> bool:
    return row is not None and row.status in ("finished", "diverged")


def latest_train_record(run_dir: Path) -> dict[str, Any] | None:
    """The last ``train`` line of a run's metrics.jsonl (what its trainer has logged so far)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now
            continue
        if rec.get("kind") == "train":
            return rec
    return None


class _FieldsColumn(ProgressColumn):
    """Shows whatever live fields a task carries (the trainer's loss and tokens/s) without
    requiring them, so the suite's own task and any trainer's task share one display."""

    def render(self, task: Task) -> Text:
        parts = []
        if task.fields.get("loss") not in (None, "", "-"):
            parts.append(f"loss {task.fields['loss']}")
        if task.fields.get("tok_s") not in (None, "", "-"):
            parts.append(f"{task.fields['tok_s']} tok/s")
        if task.fields.get("note"):
            parts.append(str(task.fields["note"]))
        return Text("  ".join(parts))


class EtaColumn(ProgressColumn):
    """Time left. The suite's task carries a ``SuiteEta`` (field ``eta``), since rich's own
    estimate needs completed units at a steady pace and a suite completes a few runs, hours
    apart; a run's task gets rich's estimate from its steps."""

    def __init__(self) -> None:
        super().__init__()
        self.per_run = TimeRemainingColumn()

    def render(self, task: Task) -> Text:
        eta = task.fields.get("eta")
        if not isinstance(eta, SuiteEta):
            return self.per_run.render(task)
        seconds = eta.seconds()
        return Text("-:--:--" if seconds is None else clock(seconds), style="progress.remaining")


def make_progress(console: Console) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    _FieldsColumn(), TimeElapsedColumn(), TextColumn("ETA"), EtaColumn(),
                    console=console)


class SuiteEta:
    """The suite's time left: for every run still to train in this call, the tokens it has left
    over the rate expected for its label (``_rate``: measured in finished runs, else the
    baseline's scaled by FLOPs, else the suite's ``estimate.tokens_per_s``; failing all, the
    tokens/s the runs in progress log), divided among the runs trained at once. Estimated anew
    every ``every`` seconds and at every run's end, counted down in between."""

    def __init__(self, plan: Plan, rows: dict[str, RunRow | None], todo: list[PlannedRun], jobs: int,
                 every: float = 2.0) -> None:
        self.plan, self.jobs, self.every = plan, max(1, jobs), every
        self.rows = {k: v for k, v in rows.items() if v is not None}
        self.left = {r.run_id: r for r in todo}
        self._lock = threading.Lock()  # rendered from rich's refresh thread
        self._at, self._value = -math.inf, None

    def ended(self, run: PlannedRun, row: RunRow | None) -> None:
        """``run`` is off the list (trained, diverged, stopped or left to another process)."""
        with self._lock:
            self.left.pop(run.run_id, None)
            if row is not None:
                self.rows[row.run_id] = row
            self._at = -math.inf

    def seconds(self) -> float | None:
        now = time.monotonic()
        with self._lock:
            if now - self._at >= self.every:
                self._value, self._at = self.estimate(), now
            value, at = self._value, self._at
        return None if value is None else max(0.0, value - (now - at))

    def estimate(self) -> float | None:
        left = list(self.left.values())
        if not left:
            return 0.0
        logged = {r.run_id: latest_train_record(self.plan.out_dir / RUNS_DIR / r.run_id) for r in left}
        live: dict[str, list[float]] = {}
        for r in left:
            rec = logged[r.run_id]
            if rec is not None and rec.get("tokens_per_s"):
                live.setdefault(r.label, []).append(float(rec["tokens_per_s"]))
        live_rates = {label: statistics.median(v) for label, v in live.items()}
        total = 0.0
        for r in left:
            rate, _ = _rate(self.plan, self.rows, r.label, live_rates)
            if not rate:
                return None
            rec = logged[r.run_id]
            done = int(rec.get("tokens", 0)) if rec is not None else 0  # resumed runs
            total += max(0, r.tokens - done) / rate
        return total / min(self.jobs, len(left))


# ---- one run ---------------------------------------------------------------------------------


def end_run(progress: Progress, overall: TaskID, message: str, task: TaskID | None = None) -> None:
    """Replace the run's live task (every task but the suite's when ``task`` is None: the trainer
    adds its own) by one line, so a long suite's display stays short."""
    for t in list(progress.task_ids):
        if t != overall and (task is None or t == task):
            progress.remove_task(t)
    progress.advance(overall)
    progress.console.print(message, highlight=False)


# ---- the plan --------------------------------------------------------------------------------
def _rate(plan: Plan, rows: dict[str, RunRow], label: str,
          live: dict[str, float] | None = None) -> tuple[float | None, str]:
    """End-to-end tokens/s expected for ``label``: measured when possible (finished runs, else
    ``live``: what runs in progress report), else scaled by FLOPs."""
    def measured(lbl: str) -> float | None:
        rates = [r.tokens_per_s for r in rows.values()
                 if r.label == lbl and r.status == "finished" and r.tokens_per_s]
        return statistics.median(rates) if rates else (live or {}).get(lbl)

    own = measured(label)
    if own:
        return own, "measured"
    fpt = {r.label: r.costs["train_flops_per_token"] for r in plan.runs}
    scale = fpt[plan.suite.baseline] / fpt[label]
    base = measured(plan.suite.baseline)
    if base:
        return base * scale, "baseline measured, scaled by FLOPs"
    if plan.suite.tokens_per_s:
        return plan.suite.tokens_per_s * scale, "suite estimate.tokens_per_s, scaled by FLOPs"
    return None, "no estimate (set estimate.tokens_per_s in the suite)"


def plan_table(plan: Plan, runs: list[PlannedRun], rows: dict[str, RunRow],
               live: set[str] | dict[str, Any] | None = None) -> tuple[Table, str]:
    """The ``--dry-run`` view: one line per run (label and init seed) with its budget, costs,
    status and time left, plus a one-line summary (total tokens, estimated time and where the
    estimate comes from). ``live``: the keys of live claims (``ResultStore.live_claims``), which
    tell a run that is training now (``running``) from one whose process is gone
    (``interrupted``); None shows the stored status."""
    budgets = plan.suite.budget.tokens
    table = Table(title=f"suite {plan.suite.name}: {len(runs)} runs, budget{'s' if len(budgets) > 1 else ''} "
                        f"{', '.join(si(b) for b in budgets)} tokens ({plan.suite.budget.match}"
                        + "".join(f"; {k}: {m}" for k, m in sorted(plan.suite.budget.variant_match.items()))
                        + ")",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("run", "data\nseed", "steps", "tokens", "params", "train\nFLOP/tok",
                "prefill\nFLOP/tok", "decode\nFLOP/tok", "decode\nB/step", "status", "est.\ntime"):
        left = col in ("run", "status")
        table.add_column(col, justify="left" if left else "right", no_wrap=left)
    total_s, sources, unknown = 0.0, set(), False
    states: dict[str, int] = {}
    for run in runs:
        row = rows.get(run.run_id)
        status = "pending" if row is None else row.status if live is None else display_status(row, live)
        states[status] = states.get(status, 0) + 1
        rate, source = _rate(plan, rows, run.label)
        if is_done(row):
            est = "-"
        elif rate:
            seconds = run.tokens / rate
            total_s += seconds
            sources.add(source)
            est = duration(seconds)
        else:
            unknown = True
            sources.add(source)
            est = "?"
        c = run.costs
        name = f"{run.label} s{run.init_seed}" + (f" @{si(run.budget)}" if len(budgets) > 1 else "")
        table.add_row(name, str(run.data_seed), str(run.steps), si(run.tokens),
                      si(c["params_total"]) + ("" if c["params_active"] == c["params_total"]
                                                else f" ({si(c['params_active'])} act)"),
                      si(c["train_flops_per_token"]), si(c["prefill_flops_per_token"]),
                      si(c["decode_flops_per_token"]), si(c["decode_bytes_per_step"], "B"), status, est)
    left = [r for r in runs if not is_done(rows.get(r.run_id))]
    summary = (f"{len(left)} of {len(runs)} runs to train, {si(sum(r.tokens for r in left))} tokens; "
               f"estimated time {'at least ' if unknown else ''}{duration(total_s)} "
               f"({'; '.join(sorted(sources)) or 'nothing to run'}); decode costs at context "
               f"{runs[0].cost_context if runs else '-'}")
    if runs:
        summary += f"; schedule: {runs[0].config.train.schedule_text()} (the baseline's first run)"
    if states.get("running"):
        summary += f"; {states['running']} being trained by a live process now"
    if states.get("interrupted"):
        summary += (f"; {states['interrupted']} interrupted (the process training "
                    f"{'it' if states['interrupted'] == 1 else 'them'} is gone; compare resumes "
                    f"{'it' if states['interrupted'] == 1 else 'them'} from the last checkpoint)")
    spec = plan.suite.costs
    if spec.measure == "always" or (spec.measure == "auto" and any(r.config.train.device != "cpu" for r in runs)):
        where = "of runs on CUDA" if spec.measure == "auto" else "on the runs' device"
        summary += (f"; then measured latency {where} (costs.measure {spec.measure}), one finished run per "
                    f"variant: prefill of {spec.prompt} tokens, decode at batch "
                    f"{', '.join(map(str, spec.batches))} with context {runs[0].cost_context if runs else '-'} "
                    "(not in the estimate)")
    if plan.suite.eval.tasks:
        limit = plan.suite.eval.limit
        summary += (f"; then zero-shot {', '.join(plan.suite.eval.tasks)} on every finished run "
                    f"({f'first {limit} items' if limit else 'every item'} per task, not in the estimate)")
    return table, summary
