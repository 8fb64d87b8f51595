"""Running a suite: train what is missing, resume what was interrupted, record every result.

Resuming is the default and needs no bookkeeping beyond the database and the run directories:
a run whose row is ``finished`` (or ``diverged``) is skipped; any other planned run is trained
with ``resume=True`` in its own directory, so an interrupted run continues from its latest
checkpoint. A row is marked finished in one transaction after the trainer returns, so a kill at
any moment leaves either a finished row or a resumable run, never a half-recorded result.

Downstream evaluation (a suite's ``eval.tasks``) runs in this process right after a run is
recorded finished, on the run's final checkpoint, and is stored in one more transaction (the
``downstream`` table). Whatever a run lacks for the suite's current tasks and item limit (an
evaluation interrupted by a kill, or tasks added to the suite later) is evaluated on the next
``compare`` before any training, without retraining.
"""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import json
import multiprocessing
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
from archlab.errors import ArchlabError, CheckpointError, TrainingDiverged
from archlab.lab.fmt import duration, si
from archlab.lab.plan import DataJob, Plan, PlannedRun
from archlab.lab.store import ResultStore, RunRow, RunStart, TrainOutcome

RUNS_DIR = "runs"


class TrainFn(Protocol):
    """``archlab.train.trainer.train``'s signature, as the lab calls it."""

    def __call__(self, cfg: RunConfig, out_dir: Path, *, resume: bool = True,
                 progress: Progress | None = None, stop_after_steps: int | None = None) -> TrainOutcome: ...


PrepareFn = Callable[..., Any]


class EvalFn(Protocol):
    """Zero-shot evaluation of a finished run: ``{task: metrics}`` (``archlab.eval.evaluate``'s
    dict) of the final checkpoint in ``run_dir`` on the loaded task items; ``progress`` is called
    with the number of requests scored so far, batch by batch (optional)."""

    def __call__(self, run_dir: Path, cfg: RunConfig, tasks: dict[str, list[Any]], *,
                 progress: Callable[[int], None] | None = None) -> dict[str, dict[str, Any]]: ...


@dataclass(frozen=True)
class SuiteOutcome:
    skipped: int  # already finished or diverged before this call
    finished: int  # finished in this call
    diverged: int  # diverged in this call
    interrupted: str | None  # run id left unfinished by stop_after_steps, if any


def _real_train() -> TrainFn:
    from archlab.train.trainer import train

    return train


def evaluate_run(run_dir: Path, cfg: RunConfig, tasks: dict[str, list[Any]], *,
                 progress: Callable[[int], None] | None = None) -> dict[str, dict[str, Any]]:
    """The real ``EvalFn``: ``archlab eval --tasks`` on the run's latest (= final) checkpoint, on
    the run's device, ``train.batch_size`` sequences per forward pass."""
    from archlab.eval.harness import evaluate_checkpoint
    from archlab.io.device import resolve_device

    results, _ = evaluate_checkpoint(run_dir, tasks, device=resolve_device(cfg.train.device),
                                     batch_size=cfg.train.batch_size, progress=progress)
    return results


def _real_prepare() -> PrepareFn:
    from archlab.data.prepare import prepare

    return prepare


def prepare_job(job: DataJob, prepare_fn: PrepareFn | None = None) -> None:
    """Prepare one suite corpus: a ``prepare`` source spec, or a recipe fetched from its registry."""
    prep = prepare_fn or _real_prepare()
    source: Any = job.source
    if job.recipe is not None:
        from archlab.data.recipes import open_recipe

        source = open_recipe(job.recipe, max_bytes=job.max_bytes)
        prep(source=source, out_dir=job.path, vocab_size=job.vocab_size, max_bytes=None)
        return
    prep(source=source, out_dir=job.path, vocab_size=job.vocab_size, max_bytes=job.max_bytes)


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
              stop_after_steps: int | None = None, jobs: int = 1,
              eval_fn: EvalFn | None = None) -> SuiteOutcome:
    """Train every run of ``runs`` that is not finished, in order, recording each in ``store``.

    ``stop_after_steps`` is passed to the trainer (a time-boxed session, or a test of resuming);
    a run that comes back short of its planned steps stays ``running`` and the suite stops there.
    ``TrainingDiverged`` marks the run diverged (a result: the variant is unstable at this
    setting) and the suite goes on; any other error propagates, leaving the run resumable.
    ``jobs > 1`` trains that many runs at once, each in its own process (see ``_run_parallel``).
    With ``eval.tasks`` in the suite, every finished run is evaluated on them (``eval_fn``, by
    default ``evaluate_run``); the task data is read before anything trains.
    """
    console = console or Console()
    store.set_meta("plan", plan.meta())
    rows = {r.run_id: store.get(r.run_id) for r in runs}
    todo = [r for r in runs if not is_done(rows[r.run_id])]
    skipped = len(runs) - len(todo)
    if skipped:
        console.print(f"[dim]{skipped} of {len(runs)} runs already done; skipping them[/dim]")
    trained = [r for r in runs if rows[r.run_id] is not None and rows[r.run_id].status == "finished"]
    downstream = _Downstream.open(plan, store, eval_fn, todo, trained)
    needed = {Path(r.config.data.path) for r in todo}
    for job in plan.data_jobs:
        if job.path in needed and not job.path.exists():
            console.print(f"preparing {job.describe()} (vocab {job.vocab_size}) into {job.path}")
            prepare_job(job, prepare_fn)
    revision = code_revision()
    with make_progress(console) as progress:
        overall = progress.add_task(f"suite {plan.suite.name}", total=len(runs), completed=skipped)
        if downstream is not None:
            downstream.catch_up(progress)
        if jobs > 1 and len(todo) > 1:
            return _run_parallel(plan, store, todo, skipped, revision, progress, overall, train_fn,
                                 stop_after_steps, jobs, downstream)
        train = train_fn or _real_train()
        finished = diverged = 0
        for run in todo:
            progress.update(overall, description=f"suite {plan.suite.name}: {run.label} seed {run.init_seed}")
            _start_row(store, plan, run, revision)
            try:
                result = train(run.config, plan.out_dir / RUNS_DIR / run.run_id, resume=True,
                               progress=progress, stop_after_steps=stop_after_steps)
            except TrainingDiverged as e:
                _record_diverged(store, run, e, progress, overall)
                diverged += 1
                continue
            if not _record_result(store, plan, run, result, progress, overall):
                return SuiteOutcome(skipped, finished, diverged, run.run_id)
            finished += 1
            if downstream is not None:
                downstream.evaluate(run, progress)
    return SuiteOutcome(skipped, finished, diverged, None)


def _start_row(store: ResultStore, plan: Plan, run: PlannedRun, revision: str) -> None:
    store.start_run(RunStart(
        run_id=run.run_id, suite=plan.suite.name, label=run.label, role=run.role,
        init_seed=run.init_seed, data_seed=run.data_seed, config=run.config.to_dict(),
        config_hash=run.config_hash, code_revision=revision, planned_tokens=run.tokens,
        planned_steps=run.steps, costs=run.costs, cost_context=run.cost_context))


def _record_diverged(store: ResultStore, run: PlannedRun, err: TrainingDiverged, progress: Progress,
                     overall: TaskID, task: TaskID | None = None) -> None:
    store.mark_diverged(run.run_id, str(err))
    _end_run(progress, overall, f"[red]{run.label} seed {run.init_seed} diverged[/red]: {err}", task)


def _record_result(store: ResultStore, plan: Plan, run: PlannedRun, result: TrainOutcome, progress: Progress,
                   overall: TaskID, task: TaskID | None = None) -> bool:
    """Mark the run finished (True) or, when it stopped short of its steps, leave it resumable."""
    if result.steps < run.steps:
        _end_run(progress, overall, f"{run.label} seed {run.init_seed} stopped at step "
                                    f"{result.steps} of {run.steps}; run compare again to continue it", task)
        return False
    loss, bpb = final_metrics(result.val_curve, plan.suite.eval.last_k,
                              (result.final_val_loss, result.final_val_bpb))
    store.finish_run(run.run_id, result, final_val_loss=loss, final_val_bpb=bpb)
    _end_run(progress, overall, f"{run.label} seed {run.init_seed}: val loss {loss:.4f} "
                                f"({bpb:.4f} bits/byte), {si(result.tokens)} tokens, "
                                f"{result.tokens_per_s:,.0f} tok/s, {duration(result.wall_s)}", task)
    return True


class _Downstream:
    """The suite's downstream tasks, loaded once, and what each run still lacks of them."""

    def __init__(self, plan: Plan, store: ResultStore, eval_fn: EvalFn, tasks: dict[str, list[Any]],
                 sources: dict[str, str], pending: list[PlannedRun]) -> None:
        self.plan, self.store, self.eval_fn = plan, store, eval_fn
        self.tasks, self.sources, self.pending = tasks, sources, pending
        self.limit = plan.suite.eval.limit

    @classmethod
    def open(cls, plan: Plan, store: ResultStore, eval_fn: EvalFn | None, todo: list[PlannedRun],
             finished: list[PlannedRun]) -> "_Downstream | None":
        """None when the suite has no tasks, or nothing to train and nothing left to evaluate;
        else the task items, read now so that missing task data fails before any training."""
        spec = plan.suite.eval
        if not spec.tasks:
            return None
        pending = [r for r in finished if _missing(store, r, spec.tasks, spec.limit)]
        if not todo and not pending:
            return None
        from archlab.eval.tasks import find_task, load_task

        sources = {name: str(find_task(name, spec.task_dir)) for name in spec.tasks}
        tasks = {name: load_task(name, src, spec.limit) for name, src in sources.items()}
        return cls(plan, store, eval_fn or evaluate_run, tasks, sources, pending)

    def catch_up(self, progress: Progress) -> None:
        """Evaluate the runs that finished training in an earlier call but lack results. A run
        whose checkpoint is gone (run directories deleted to save space) is reported and left
        without them rather than blocking the suite."""
        if self.pending:
            progress.console.print(f"evaluating {len(self.pending)} finished run(s) on the downstream "
                                   "tasks they lack", highlight=False)
        for run in self.pending:
            try:
                self.evaluate(run, progress)
            except CheckpointError as e:
                progress.console.print(f"[yellow]{run.label} seed {run.init_seed}: no downstream "
                                       f"evaluation[/yellow]: {e}", highlight=False)

    def evaluate(self, run: PlannedRun, progress: Progress) -> None:
        """Evaluate one finished run on the tasks it lacks and store the results together."""
        missing = _missing(self.store, run, tuple(self.tasks), self.limit)
        if not missing:
            return
        from archlab.eval.harness import n_requests

        items = {name: self.tasks[name] for name in missing}
        task = progress.add_task(f"eval {run.label} seed {run.init_seed}",
                                 total=sum(n_requests(v) for v in items.values()))
        try:
            results = self.eval_fn(self.plan.out_dir / RUNS_DIR / run.run_id, run.config, items,
                                   progress=lambda k: progress.advance(task, k))
        finally:
            progress.remove_task(task)
        if set(results) != set(items):
            raise RuntimeError(f"downstream evaluation of {run.run_id} returned tasks {sorted(results)}, "
                               f"expected {sorted(items)}")
        self.store.add_downstream(run.run_id, results, limit=self.limit, sources=self.sources)
        scores = ", ".join(f"{name} {_headline(r)}" for name, r in results.items())
        progress.console.print(f"{run.label} seed {run.init_seed} downstream: {scores}", highlight=False)


def _missing(store: ResultStore, run: PlannedRun, tasks: tuple[str, ...], limit: int | None) -> list[str]:
    have = {d.task for d in store.downstream(run.run_id) if d.limit == limit}
    return [t for t in tasks if t not in have]


def _headline(r: dict[str, Any]) -> str:
    """acc_norm for multiple choice, acc for LAMBADA (what the report shows)."""
    return f"acc_norm {r['acc_norm']:.4f}" if r.get("acc_norm") is not None else f"acc {r['acc']:.4f}"


def _train_worker(train_fn: TrainFn | None, cfg: RunConfig, out_dir: Path,
                  stop_after_steps: int | None) -> TrainOutcome:
    """One run in a worker process. The parent draws the progress, so the real trainer is quiet."""
    if train_fn is None:
        from archlab.train.trainer import train

        return train(cfg, out_dir, resume=True, stop_after_steps=stop_after_steps, show_progress=False)
    return train_fn(cfg, out_dir, resume=True, progress=None, stop_after_steps=stop_after_steps)


def _latest_train_record(run_dir: Path) -> dict[str, Any] | None:
    """The last ``train`` line of a run's metrics.jsonl (what a worker has logged so far)."""
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


def _run_parallel(plan: Plan, store: ResultStore, todo: list[PlannedRun], skipped: int, revision: str,
                  progress: Progress, overall: TaskID, train_fn: TrainFn | None,
                  stop_after_steps: int | None, jobs: int, downstream: _Downstream | None = None) -> SuiteOutcome:
    """Train up to ``jobs`` runs at once, each in a fresh (spawned) process.

    Small models leave a GPU mostly idle between kernel launches, so several runs side by side
    finish a suite sooner; each run is still exactly the run ``jobs=1`` would train (its own
    seeds, data order and directory). This process alone writes the database; workers report
    progress through their metrics.jsonl, which is polled here for the progress bars.
    Downstream evaluations run in this process too, one at a time, after the finished run's slot
    has gone to the next run (training does not wait for them; the bars pause meanwhile).
    """
    finished = diverged = 0
    interrupted: str | None = None
    error: BaseException | None = None
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        pending: dict[cf.Future[TrainOutcome], tuple[PlannedRun, TaskID]] = {}
        queue = list(todo)

        def submit() -> None:
            while queue and len(pending) < jobs and error is None:
                run = queue.pop(0)
                _start_row(store, plan, run, revision)
                task = progress.add_task(f"{run.label} seed {run.init_seed}", total=run.steps, loss="-",
                                         tok_s="-")
                fut = pool.submit(_train_worker, train_fn, run.config, plan.out_dir / RUNS_DIR / run.run_id,
                                  stop_after_steps)
                pending[fut] = (run, task)

        submit()
        while pending:
            done, _ = cf.wait(pending, timeout=2.0, return_when=cf.FIRST_COMPLETED)
            for fut, (run, task) in pending.items():
                if fut not in done:
                    rec = _latest_train_record(plan.out_dir / RUNS_DIR / run.run_id)
                    if rec is not None:
                        progress.update(task, completed=rec["step"], loss=f"{rec['loss']:.3f}",
                                        tok_s=f"{rec['tokens_per_s']:,.0f}")
            evaluate: list[PlannedRun] = []
            for fut in done:
                run, task = pending.pop(fut)
                try:
                    result = fut.result()
                except TrainingDiverged as e:
                    _record_diverged(store, run, e, progress, overall, task)
                    diverged += 1
                    continue
                except BaseException as e:  # noqa: BLE001 - re-raised once the running runs end
                    progress.remove_task(task)
                    error = error or e
                    continue
                if _record_result(store, plan, run, result, progress, overall, task):
                    finished += 1
                    evaluate.append(run)
                else:
                    interrupted = interrupted or run.run_id
            if interrupted is None:
                submit()
            for run in evaluate:
                if downstream is None or error is not None:
                    break  # left for the next compare, like an interrupted evaluation
                try:
                    downstream.evaluate(run, progress)
                except BaseException as e:  # noqa: BLE001 - re-raised once the running runs end
                    error = e
    if error is not None:
        raise error
    return SuiteOutcome(skipped, finished, diverged, interrupted)


def _end_run(progress: Progress, overall: TaskID, message: str, task: TaskID | None = None) -> None:
    """Replace the run's live task (every task but the suite's when ``task`` is None: the trainer
    adds its own) by one line, so a long suite's display stays short."""
    for t in list(progress.task_ids):
        if t != overall and (task is None or t == task):
            progress.remove_task(t)
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
    if plan.suite.eval.tasks:
        limit = plan.suite.eval.limit
        summary += (f"; then zero-shot {', '.join(plan.suite.eval.tasks)} on every finished run "
                    f"({f'first {limit} items' if limit else 'every item'} per task, not in the estimate)")
    return table, summary
