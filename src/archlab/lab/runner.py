"""Running a suite: train what is missing, resume what was interrupted, record every result.

Resuming is the default and needs no bookkeeping beyond the database and the run directories:
a run whose row is ``finished`` (or ``diverged``) is skipped; any other planned run is trained
with ``resume=True`` in its own directory, so an interrupted run continues from its latest
checkpoint. A row is marked finished in one transaction after the trainer returns, so a kill at
any moment leaves either a finished row or a resumable run, never a half-recorded result.
"""

from __future__ import annotations

import fcntl
import os
import statistics
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from rich import box
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TaskID,
                           TextColumn, TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

import archlab
from archlab.config import RunConfig
from archlab.errors import ArchlabError, TrainingDiverged
from archlab.lab.fmt import duration, si
from archlab.lab.plan import Plan, PlannedRun
from archlab.lab.store import ResultStore, RunRow, RunStart, TrainOutcome

RUNS_DIR = "runs"


class TrainFn(Protocol):
    """``archlab.train.trainer.train``'s signature, as the lab calls it."""

    def __call__(self, cfg: RunConfig, out_dir: Path, *, resume: bool = True,
                 progress: Progress | None = None, stop_after_steps: int | None = None) -> TrainOutcome: ...


PrepareFn = Callable[..., Any]


@dataclass(frozen=True)
class SuiteOutcome:
    skipped: int  # already finished or diverged before this call
    finished: int  # finished in this call
    diverged: int  # diverged in this call
    interrupted: str | None  # run id left unfinished by stop_after_steps, if any


def _real_train() -> TrainFn:
    from archlab.train.trainer import train

    return train


def _real_prepare() -> PrepareFn:
    from archlab.data.prepare import prepare

    return prepare


def code_revision() -> str:
    """``git rev-parse HEAD`` of archlab's own checkout (``+dirty`` with uncommitted changes to
    tracked files), or ``unknown`` when archlab is not running from a git checkout."""
    pkg = str(Path(archlab.__file__).resolve().parent)
    try:
        head = subprocess.run(["git", "-C", pkg, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", pkg, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def final_metrics(val_curve: list[dict[str, Any]], last_k: int, fallback: tuple[float, float]) -> tuple[float, float]:
    """Final (loss, bpb): the mean of the last ``last_k`` evaluations, which damps the noise of
    a single evaluation; the trainer's own final values when it logged no curve."""
    tail = val_curve[-last_k:]
    if not tail:
        return fallback
    return (statistics.fmean(float(p["loss"]) for p in tail),
            statistics.fmean(float(p["bpb"]) for p in tail))


def is_done(row: RunRow | None) -> bool:
    return row is not None and row.status in ("finished", "diverged")


@contextmanager
def suite_lock(out_dir: Path) -> Iterator[None]:
    """One ``compare`` per suite directory: two would train the same run into one directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArchlabError(f"another archlab compare is running in {out_dir}") from None
        yield
    finally:
        os.close(fd)


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


def make_progress(console: Console) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    _FieldsColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=console)


def run_suite(plan: Plan, store: ResultStore, runs: list[PlannedRun], *, train_fn: TrainFn | None = None,
              prepare_fn: PrepareFn | None = None, console: Console | None = None,
              stop_after_steps: int | None = None) -> SuiteOutcome:
    """Train every run of ``runs`` that is not finished, in order, recording each in ``store``.

    ``stop_after_steps`` is passed to the trainer (a time-boxed session, or a test of resuming);
    a run that comes back short of its planned steps stays ``running`` and the suite stops there.
    ``TrainingDiverged`` marks the run diverged (a result: the variant is unstable at this
    setting) and the suite goes on; any other error propagates, leaving the run resumable.
    """
    console = console or Console()
    train = train_fn or _real_train()
    store.set_meta("plan", plan.meta())
    todo = [r for r in runs if not is_done(store.get(r.run_id))]
    skipped = len(runs) - len(todo)
    if skipped:
        console.print(f"[dim]{skipped} of {len(runs)} runs already done; skipping them[/dim]")
    needed = {Path(r.config.data.path) for r in todo}
    jobs = [j for j in plan.data_jobs if j.path in needed and not j.path.exists()]
    if jobs:
        prep = prepare_fn or _real_prepare()
        for job in jobs:
            console.print(f"preparing {job.source} (vocab {job.vocab_size}) into {job.path}")
            prep(source=job.source, out_dir=job.path, vocab_size=job.vocab_size, max_bytes=job.max_bytes)
    revision = code_revision()
    finished = diverged = 0
    with make_progress(console) as progress:
        overall = progress.add_task(f"suite {plan.suite.name}", total=len(runs), completed=skipped)
        for run in todo:
            progress.update(overall, description=f"suite {plan.suite.name}: {run.label} seed {run.init_seed}")
            store.start_run(RunStart(
                run_id=run.run_id, suite=plan.suite.name, label=run.label, role=run.role,
                init_seed=run.init_seed, data_seed=run.data_seed, config=run.config.to_dict(),
                config_hash=run.config_hash, code_revision=revision, planned_tokens=run.tokens,
                planned_steps=run.steps, costs=run.costs, cost_context=run.cost_context))
            try:
                result = train(run.config, plan.out_dir / RUNS_DIR / run.run_id, resume=True,
                               progress=progress, stop_after_steps=stop_after_steps)
            except TrainingDiverged as e:
                store.mark_diverged(run.run_id, str(e))
                diverged += 1
                _end_run(progress, overall, f"[red]{run.label} seed {run.init_seed} diverged[/red]: {e}")
                continue
            if result.steps < run.steps:
                _end_run(progress, overall, f"{run.label} seed {run.init_seed} stopped at step "
                                            f"{result.steps} of {run.steps}; run compare again to continue it")
                return SuiteOutcome(skipped, finished, diverged, run.run_id)
            loss, bpb = final_metrics(result.val_curve, plan.suite.eval.last_k,
                                      (result.final_val_loss, result.final_val_bpb))
            store.finish_run(run.run_id, result, final_val_loss=loss, final_val_bpb=bpb)
            finished += 1
            _end_run(progress, overall, f"{run.label} seed {run.init_seed}: val loss {loss:.4f} "
                                        f"({bpb:.4f} bits/byte), {si(result.tokens)} tokens, "
                                        f"{result.tokens_per_s:,.0f} tok/s, {duration(result.wall_s)}")
    return SuiteOutcome(skipped, finished, diverged, None)


def _end_run(progress: Progress, overall: TaskID, message: str) -> None:
    """Replace the trainer's live task(s) by one line, so a long suite's display stays short."""
    for task in list(progress.task_ids):
        if task != overall:
            progress.remove_task(task)
    progress.advance(overall)
    progress.console.print(message, highlight=False)


def _rate(plan: Plan, rows: dict[str, RunRow], label: str) -> tuple[float | None, str]:
    """End-to-end tokens/s expected for ``label``: measured when possible, else scaled by FLOPs."""
    def measured(lbl: str) -> float | None:
        rates = [r.tokens_per_s for r in rows.values()
                 if r.label == lbl and r.status == "finished" and r.tokens_per_s]
        return statistics.median(rates) if rates else None

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


def plan_table(plan: Plan, runs: list[PlannedRun], rows: dict[str, RunRow]) -> tuple[Table, str]:
    """The ``--dry-run`` view: one line per run (label and init seed) with its budget, costs,
    status and time left, plus a one-line summary (total tokens, estimated time and where the
    estimate comes from)."""
    table = Table(title=f"suite {plan.suite.name}: {len(runs)} runs, budget "
                        f"{si(plan.suite.budget.tokens)} tokens ({plan.suite.budget.match})",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("run", "data\nseed", "steps", "tokens", "params", "train\nFLOP/tok",
                "prefill\nFLOP/tok", "decode\nFLOP/tok", "decode\nB/step", "status", "est.\ntime"):
        left = col in ("run", "status")
        table.add_column(col, justify="left" if left else "right", no_wrap=left)
    total_s, sources, unknown = 0.0, set(), False
    for run in runs:
        row = rows.get(run.run_id)
        status = row.status if row else "pending"
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
        table.add_row(f"{run.label} s{run.init_seed}", str(run.data_seed), str(run.steps), si(run.tokens),
                      si(c["params_total"]) + ("" if c["params_active"] == c["params_total"]
                                                else f" ({si(c['params_active'])} act)"),
                      si(c["train_flops_per_token"]), si(c["prefill_flops_per_token"]),
                      si(c["decode_flops_per_token"]), si(c["decode_bytes_per_step"], "B"), status, est)
    left = [r for r in runs if not is_done(rows.get(r.run_id))]
    summary = (f"{len(left)} of {len(runs)} runs to train, {si(sum(r.tokens for r in left))} tokens; "
               f"estimated time {'at least ' if unknown else ''}{duration(total_s)} "
               f"({'; '.join(sorted(sources)) or 'nothing to run'}); decode costs at context "
               f"{runs[0].cost_context if runs else '-'}")
    return table, summary
