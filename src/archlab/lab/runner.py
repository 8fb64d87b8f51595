"""Running a suite: train what is missing, resume what was interrupted, record every result.

Resuming is the default and needs no bookkeeping beyond the database and the run directories:
a run whose row is ``finished`` (or ``diverged``) is skipped; any other planned run is trained
with ``resume=True`` in its own directory, so an interrupted run continues from its latest
checkpoint. A row is marked finished in one transaction after the trainer returns, so a kill at
any moment leaves either a finished row or a resumable run, never a half-recorded result.

Every run is *claimed* by the process that trains it (``ResultStore.claim_run``: its pid, host
and start time, taken in the same transaction that creates or resumes the row, released by the
one that records the result). A claim whose process is gone (killed, machine rebooted) is taken
over by the next ``compare``; a live one is left alone: the run is skipped and reported as being
trained elsewhere, never trained twice. So several ``compare`` processes may work on one suite
directory at once (the suite lock is shared; only ``--no-resume`` takes it alone), and with
``--jobs N`` the claims are the workers' own: a worker that outlived its parent could not train
a run that a re-run has claimed, and workers do not outlive it anyway (``die_with_parent``).

Two machines can split a suite the same way: both run the same ``archlab compare SUITE --out
DIR`` on one shared suite directory, and each trains the runs nobody has claimed. A pid means
nothing on another host, so a claim from another machine counts as live while its holder's
heartbeat is fresh (refreshed every 30 s; gone after 5 minutes of silence: a lease, whose two
times ``ARCHLAB_CLAIM_HEARTBEAT_S`` and ``ARCHLAB_CLAIM_LEASE_S`` set); a machine that dies
leaves its runs to the other one after that, resumed from the checkpoints in the shared run
directories. The limit is SQLite's: the results database is in WAL mode, which needs every
process that opens it to share memory with the others, so the directory must be on a filesystem
those processes see as local, e.g. one host's disk mounted into several containers or VMs on that
host. A network filesystem (NFS, SMB) does not qualify: SQLite documents WAL as unsupported there
and the database can be corrupted.
Machines without such a filesystem split a suite with ``compare --shard I/N`` instead (each
trains its share of ``archlab.lab.plan.shard_ids`` into a directory of its own), and one of them
brings the directories together with ``archlab merge`` (``archlab.lab.merge``).

With ``gpus`` (``compare --gpus``) every run trains in a fresh worker process pinned to the
GPU(s) it was given by ``CUDA_VISIBLE_DEVICES`` (``archlab.lab.launchers.GpuLauncher``, ``archlab.lab.worker``), as
many at once as the GPUs have slots (``archlab.lab.gpus``); the worker claims and records its
run like a ``--jobs`` worker, and one with several GPUs trains its run under torchrun.

Downstream evaluation (a suite's ``eval.tasks``) runs in this process right after a run is
recorded finished, on the run's final checkpoint, and is stored in one more transaction (the
``downstream`` table). Whatever a run lacks for the suite's current tasks and item limit (an
evaluation interrupted by a kill, or tasks added to the suite later) is evaluated on the next
``compare`` before any training, without retraining. Evaluations are claimed too.

Measured latency (a suite's ``costs.measure``) is taken in this process too, after every run of
the call has finished and only while no other process trains on this host, one variant after
another, and stored in the ``latency`` table; what is missing is measured on the next ``compare``
(``archlab.lab.latency`` says why it is done this way).
"""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import io
import os
import statistics
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Protocol

from rich.console import Console
from rich.progress import Progress, TaskID

import archlab
from archlab.config import RunConfig
from archlab.errors import ArchlabError, CheckpointError, OutOfMemory, TrainingDiverged, is_out_of_memory
from archlab.lab.store.owner import Owner
from archlab.lab.display import RUNS_DIR, SuiteEta, end_run, is_done, latest_train_record, make_progress
from archlab.lab import heldout as _heldout
from archlab.lab import latency as _latency
from archlab.lab.fmt import duration, si
from archlab.lab.gpus import GpuPlan
from archlab.lab.launchers import GpuLauncher, Launcher, PoolLauncher
from archlab.lab.plan import DataJob, Plan, PlannedRun
from archlab.lab.session import Session
from archlab.lab.stoprule import check_seed_plan
from archlab.lab.store import (FINAL_WEIGHTS, Heartbeat, ResultStore, RunRow, RunStart, TrainOutcome,
                               downstream_key)


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
    busy: tuple[str, ...] = ()  # run ids skipped: a live process elsewhere is training them
    measured: int = 0  # variants whose latency was measured in this call


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
    tracked files), or ``unknown`` when archlab is not running from a git checkout. A copy whose
    git metadata is missing or stale (a working tree copied to another machine without its
    history) names its revision in ``ARCHLAB_CODE_REVISION``, which then wins."""
    named = os.environ.get("ARCHLAB_CODE_REVISION", "").strip()
    if named:
        return named
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


def final_metrics(result: TrainOutcome, last_k: int) -> tuple[float, float, str]:
    """Final (loss, bpb, how they were obtained) of a finished run. ``last_k`` 1 (the default):
    the trainer's final evaluation, the final weights on the final sample. ``last_k`` k > 1: the
    mean of the last k evaluations of the loss curve, which the plan has checked all lie in the
    last 10% of training (``archlab.lab.plan.check_smoothing``)."""
    tail = result.val_curve[-last_k:]
    if last_k == 1 or len(tail) < last_k:
        return result.final_val_loss, result.final_val_bpb, FINAL_WEIGHTS
    return (statistics.fmean(float(p["loss"]) for p in tail), statistics.fmean(float(p["bpb"]) for p in tail),
            f"mean of last {last_k} evaluations (steps {tail[0]['step']}-{tail[-1]['step']})")


@contextmanager
def _flock_blocking(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextmanager
def suite_lock(out_dir: Path, *, exclusive: bool = False) -> Iterator[None]:
    """Held by every ``compare`` of a suite directory while it runs. Shared: compares may run at
    once, the run claims keep them off each other's runs. ``exclusive`` for ``--no-resume``,
    which moves results and run directories aside and must not do that under a running compare."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            if exclusive:
                raise ArchlabError(f"another archlab compare is running in {out_dir}; --no-resume would "
                                   "move its results from under it") from None
            raise ArchlabError(f"another archlab compare is starting {out_dir} over (--no-resume); "
                               "run this one when it has finished") from None
        yield
    finally:
        os.close(fd)


def _prepare_missing(plan: Plan, todo: list[PlannedRun], prepare_fn: PrepareFn | None, console: Console) -> None:
    """Prepare the corpora the runs to train need. Under a lock: compares sharing the suite
    directory prepare each corpus once (the others wait, then find it there)."""
    needed = {Path(r.config.data.path) for r in todo}
    jobs = [job for job in plan.data_jobs if job.path in needed and not job.path.exists()]
    if not jobs:
        return
    with _flock_blocking(plan.out_dir / ".data.lock"):
        for job in jobs:
            if job.path.exists():
                continue
            console.print(f"preparing {job.describe()} (vocab {job.vocab_size}) into {job.path}")
            prepare_job(job, prepare_fn)


# ---- progress --------------------------------------------------------------------------------
@dataclass(frozen=True)
class DownstreamJob:
    """What a worker needs to evaluate the run it trained: the suite's task items (read once, by
    ``compare``), where they came from, the item limit, and the evaluation function."""

    tasks: dict[str, list[Any]]
    sources: dict[str, str]
    limit: int | None
    eval_fn: Any


@dataclass(frozen=True)
class _Job:
    """One run to train, as plain data (a worker process receives it pickled)."""

    run: PlannedRun
    start: RunStart
    run_dir: Path
    last_k: int
    stop_after_steps: int | None
    #: evaluate the finished run on the suite's tasks in the worker (``_evaluate_in_worker``)
    downstream: DownstreamJob | None = None


def _job(plan: Plan, run: PlannedRun, revision: str, stop_after_steps: int | None,
         downstream: DownstreamJob | None = None) -> _Job:
    start = RunStart(
        run_id=run.run_id, suite=plan.suite.name, label=run.label, role=run.role,
        init_seed=run.init_seed, data_seed=run.data_seed, config=run.config.to_dict(),
        config_hash=run.config_hash, code_revision=revision, planned_tokens=run.tokens,
        planned_steps=run.steps, costs=run.costs, cost_context=run.cost_context)
    return _Job(run=run, start=start, run_dir=plan.out_dir / RUNS_DIR / run.run_id,
                last_k=plan.suite.eval.last_k, stop_after_steps=stop_after_steps, downstream=downstream)


@dataclass(frozen=True)
class RunEnd:
    """How one attempt at a run ended, and the line that says so. ``stopped``: short of its
    steps (``stop_after_steps``), resumable; ``busy``: a live process elsewhere holds its claim;
    ``done``: finished or diverged by another process before this one could claim it."""

    kind: Literal["finished", "diverged", "stopped", "busy", "done"]
    message: str
    row: RunRow | None = None  # the recorded row, when this attempt recorded one


def _release_quietly(store: ResultStore, key: str, owner: Owner) -> None:
    """Release on the way out of a failure; if even that fails, the claim goes stale with this
    process, which is the same outcome a moment later, so the original error is what matters."""
    try:
        store.release(key, owner)
    except Exception:  # noqa: BLE001
        pass


def _train_claimed(store: ResultStore, job: _Job, train: Callable[[RunConfig, Path], TrainOutcome]) -> RunEnd:
    """Claim the run, train it, record how it ended and release the claim: the whole life of
    one attempt, in the process that trains (this one, or a ``--jobs`` worker)."""
    run, owner = job.run, Owner.current()
    name = f"{run.label} seed {run.init_seed}"
    got = store.claim_run(job.start, owner)
    if got.state == "done":
        return RunEnd("done", f"{name}: recorded by another process meanwhile; skipping it")
    if got.state == "busy":
        assert got.holder is not None
        return RunEnd("busy", f"{name}: being trained by {got.holder.describe()}; skipping it")
    took = "" if got.taken_from is None else f" (taken over from {got.taken_from.describe()}, gone)"
    with Heartbeat(store.path, owner) as beat:
        beat.sample(store)
        try:
            result = train(run.config, job.run_dir)
        except TrainingDiverged as e:
            store.mark_diverged(run.run_id, str(e))  # the same transaction drops the claim
            return RunEnd("diverged", f"[red]{name} diverged[/red]{took}: {e}", store.get(run.run_id))
        except BaseException:
            _release_quietly(store, run.run_id, owner)  # resumable by whoever comes next
            raise
        if result.steps < run.steps:
            store.release(run.run_id, owner)
            return RunEnd("stopped", f"{name} stopped at step {result.steps} of {run.steps}{took}; "
                                     "run compare again to continue it")
        loss, bpb, rule = final_metrics(result, job.last_k)
        store.finish_run(run.run_id, result, final_val_loss=loss, final_val_bpb=bpb,
                         runs_at_once=beat.sample(store), final_rule=rule)
    return RunEnd("finished", f"{name}{took}: val loss {loss:.4f} ({bpb:.4f} bits/byte), "
                              f"{si(result.tokens)} tokens, {result.tokens_per_s:,.0f} tok/s, "
                              f"{duration(result.wall_s)}", store.get(run.run_id))


@dataclass
class _Tally:
    skipped: int
    finished: int = 0
    diverged: int = 0
    interrupted: str | None = None
    busy: list[str] | None = None
    measured: int = 0

    def add(self, run: PlannedRun, end: RunEnd) -> None:
        self.finished += end.kind == "finished"
        self.diverged += end.kind == "diverged"
        self.skipped += end.kind == "done"
        if end.kind == "busy":
            self.busy = [*(self.busy or []), run.run_id]
        if end.kind == "stopped":
            self.interrupted = self.interrupted or run.run_id

    def outcome(self) -> SuiteOutcome:
        return SuiteOutcome(self.skipped, self.finished, self.diverged, self.interrupted, tuple(self.busy or ()),
                            self.measured)


def run_suite(plan: Plan, store: ResultStore, runs: list[PlannedRun], *, train_fn: TrainFn | None = None,
              prepare_fn: PrepareFn | None = None, console: Console | None = None,
              stop_after_steps: int | None = None, jobs: int = 1,
              eval_fn: EvalFn | None = None, measure_fn: _latency.MeasureFn | None = None,
              session: Session | None = None, gpus: GpuPlan | None = None) -> SuiteOutcome:
    """Train every run of ``runs`` that is not finished, in order, recording each in ``store``.

    ``stop_after_steps`` is passed to the trainer (a time-boxed session, or a test of resuming);
    a run that comes back short of its planned steps stays ``running`` and the suite stops there.
    ``TrainingDiverged`` marks the run diverged (a result: the variant is unstable at this
    setting) and the suite goes on; any other error propagates, leaving the run resumable.
    A run another live process is training is skipped (``SuiteOutcome.busy``).
    ``jobs > 1`` trains that many runs at once, each in its own process (see ``_run_parallel``).
    ``gpus`` places every run on GPUs instead (``archlab.lab.gpus``; ``jobs`` is then unused): each
    run in a fresh process pinned to its GPU(s) by ``CUDA_VISIBLE_DEVICES``, as many at once as
    the GPUs have slots.
    With ``eval.tasks`` in the suite, every finished run is evaluated on them (``eval_fn``, by
    default ``evaluate_run``); the task data is read before anything trains.
    Then, unless a run stopped short, the latency of every label of ``runs`` that the suite's
    ``costs.measure`` asks for and the store lacks is measured (``measure_fn``, by default
    ``archlab.lab.latency.measure_run``), after the progress display is gone.
    """
    console = console or Console()
    # Seeds are fixed before results (archlab.lab.stoprule); ``session``: this call's limits.
    note = check_seed_plan(store, plan, amend=session is not None and session.amend_seeds)
    if note:
        console.print(note, highlight=False)
    store.set_meta("plan", plan.meta())
    rows = {r.run_id: store.get(r.run_id) for r in runs}
    todo = [r for r in runs if not is_done(rows[r.run_id])]
    tally = _Tally(skipped=len(runs) - len(todo))
    if tally.skipped:
        console.print(f"[dim]{tally.skipped} of {len(runs)} runs already done; skipping them[/dim]")
    trained = [r for r in runs if rows[r.run_id] is not None and rows[r.run_id].status == "finished"]
    downstream = _Downstream.open(plan, store, eval_fn, todo, trained)
    _prepare_missing(plan, todo, prepare_fn, console)
    _heldout.precheck(plan)  # the suite's eval_data corpora: there, and tokenized as the runs are
    revision = code_revision()
    # With GPUs even a single run goes to a worker: this process must not pick a GPU for it.
    parallel = gpus is not None or (jobs > 1 and len(todo) > 1)
    at_once = gpus.concurrency if gpus is not None else jobs
    eta = SuiteEta(plan, {r.run_id: r for r in store.runs()}, todo, at_once if parallel else 1)
    with make_progress(console) as progress:
        overall = progress.add_task(f"suite {plan.suite.name}", total=len(runs), completed=tally.skipped,
                                    eta=eta)
        if downstream is not None:
            downstream.catch_up(progress)
        if parallel:
            launcher = (GpuLauncher(gpus, store, plan.out_dir, train_fn) if gpus is not None
                        else PoolLauncher(jobs, store.path, train_fn, _train_worker))
            _run_parallel(plan, todo, tally, revision, progress, overall, stop_after_steps, eta, launcher,
                          downstream, session)
        else:
            train = train_fn or _real_train()
            for run in todo:
                if session is not None and not session.admit(plan, eta.rows, run):
                    continue
                progress.update(overall, description=f"suite {plan.suite.name}: {run.label} seed {run.init_seed}")
                end = _train_claimed(store, _job(plan, run, revision, stop_after_steps),
                                     lambda cfg, out: train(cfg, out, resume=True, progress=progress,
                                                            stop_after_steps=stop_after_steps))
                eta.ended(run, end.row)
                end_run(progress, overall, end.message)
                tally.add(run, end)
                if end.kind == "stopped":
                    break
                if end.kind == "finished" and downstream is not None:
                    downstream.evaluate(run, progress)
    _heldout.evaluate_missing(plan, store, runs, console)  # finished runs on the eval_data corpora
    # Outside the progress display (its refresh thread would share the CPU with wall-clock timings);
    # a session that stopped short is over, and measures next time.
    if tally.interrupted is None and not (session is not None and session.held_back):
        tally.measured = _latency.Latency(plan, store, measure_fn or _latency.measure_run, console).run(runs, revision)
    return tally.outcome()


class _Downstream:
    """The suite's downstream tasks, loaded once, and what each run still lacks of them."""

    def __init__(self, runs_dir: Path, limit: int | None, store: ResultStore, eval_fn: EvalFn,
                 tasks: dict[str, list[Any]], sources: dict[str, str], pending: list[PlannedRun]) -> None:
        self.runs_dir, self.limit, self.store, self.eval_fn = runs_dir, limit, store, eval_fn
        self.tasks, self.sources, self.pending = tasks, sources, pending

    def job(self) -> DownstreamJob:
        """The tasks and the evaluation function, for a worker to evaluate its own run."""
        return DownstreamJob(self.tasks, self.sources, self.limit, self.eval_fn)

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
        return cls(plan.out_dir / RUNS_DIR, spec.limit, store, eval_fn or evaluate_run, tasks, sources, pending)

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
        """Evaluate one finished run on the tasks it lacks and store the results together, under
        a claim (a compare sharing the suite directory may be about to evaluate it too)."""
        if not _missing(self.store, run, tuple(self.tasks), self.limit):
            return
        owner, key = Owner.current(), downstream_key(run.run_id)
        got = self.store.claim(key, owner)
        if got.state == "busy":
            assert got.holder is not None
            progress.console.print(f"{run.label} seed {run.init_seed} downstream: being evaluated by "
                                   f"{got.holder.describe()}; skipping it", highlight=False)
            return
        try:
            with Heartbeat(self.store.path, owner):
                self._evaluate(run, progress)
        finally:
            _release_quietly(self.store, key, owner)

    def _evaluate(self, run: PlannedRun, progress: Progress) -> None:
        missing = _missing(self.store, run, tuple(self.tasks), self.limit)  # again, now it is ours
        if not missing:
            return
        from archlab.eval.harness import n_requests

        items = {name: self.tasks[name] for name in missing}
        task = progress.add_task(f"eval {run.label} seed {run.init_seed}",
                                 total=sum(n_requests(v) for v in items.values()))
        try:
            results = self.eval_fn(self.runs_dir / run.run_id, run.config, items,
                                   progress=lambda k: progress.advance(task, k))
        finally:
            progress.remove_task(task)
        if set(results) != set(items):
            raise RuntimeError(f"downstream evaluation of {run.run_id} returned tasks {sorted(results)}, "
                               f"expected {sorted(items)}")
        from archlab.eval.tasks import chance_level

        # each task's chance level, stored with its result: the downstream verdicts draw none at chance
        results = {name: {**r, "chance": chance_level(items[name])} for name, r in results.items()}
        self.store.add_downstream(run.run_id, results, limit=self.limit, sources=self.sources)
        scores = ", ".join(f"{name} {_headline(r)}" for name, r in results.items())
        progress.console.print(f"{run.label} seed {run.init_seed} downstream: {scores}", highlight=False)


def _missing(store: ResultStore, run: PlannedRun, tasks: tuple[str, ...], limit: int | None) -> list[str]:
    have = {d.task for d in store.downstream(run.run_id) if d.limit == limit}
    return [t for t in tasks if t not in have]


def _headline(r: dict[str, Any]) -> str:
    """acc_norm for multiple choice, acc for LAMBADA (what the report shows)."""
    return f"acc_norm {r['acc_norm']:.4f}" if r.get("acc_norm") is not None else f"acc {r['acc']:.4f}"


# ---- several runs at once --------------------------------------------------------------------
def _train_worker(db_path: Path, job: _Job, train_fn: TrainFn | None) -> RunEnd:
    """One run in a worker process, which claims, trains and records it itself: the claim must
    name the process that trains. The parent draws the progress, so the trainer is quiet."""
    stop = job.stop_after_steps
    if train_fn is None:
        from archlab.train.trainer import train as real_train

        def train(cfg: RunConfig, out: Path) -> TrainOutcome:
            return real_train(cfg, out, resume=True, stop_after_steps=stop, show_progress=False)
    else:
        def train(cfg: RunConfig, out: Path) -> TrainOutcome:
            return train_fn(cfg, out, resume=True, progress=None, stop_after_steps=stop)
    try:
        with ResultStore(db_path) as store:
            end = _train_claimed(store, job, train)
            if end.kind == "finished" and job.downstream is not None:
                end = _evaluate_in_worker(store, job, end)
            return end
    except BaseException as e:
        if is_out_of_memory(e):
            # compare may give this worker the run again: hand the failed attempt's cached
            # blocks back to the driver so that the runs beside it can have them meanwhile
            e.__traceback__ = None
            _release_gpu_cache()
        raise


def _release_gpu_cache() -> None:
    import gc
    import sys

    torch = sys.modules.get("torch")
    gc.collect()
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _evaluate_in_worker(store: ResultStore, job: _Job, end: RunEnd) -> RunEnd:
    """The finished run's downstream evaluation in the worker that trained it, beside the other
    workers' training: in ``compare``'s own process the evaluations ran one at a time, and runs
    that finish together (a suite's runs of one budget, started together) queued for them with
    the GPU otherwise idle (16 runs at 20M tokens on an H200: about 230 s of a 524 s call). The
    scores join the run's end line. An evaluation that fails here is left to ``compare``, which
    evaluates whatever a finished run lacks, as before, and reports its error."""
    spec = job.downstream
    assert spec is not None
    console = Console(file=io.StringIO(), record=True, width=250)
    ds = _Downstream(job.run_dir.parent, spec.limit, store, spec.eval_fn, spec.tasks, spec.sources, [])
    try:
        with Progress(console=console, disable=True) as progress:
            ds.evaluate(job.run, progress)
    except Exception as e:  # noqa: BLE001 - compare retries it and reports the error
        return replace(end, message=f"{end.message}; its downstream evaluation is left to compare ({e})")
    said = " ".join(console.export_text().split())
    return replace(end, message=f"{end.message}\n  {said}") if said else end


def _as_user_error(run: PlannedRun, e: BaseException, alone: bool = False) -> BaseException:
    """A worker's out-of-memory error is a resource limit (too many runs on one GPU, or a run too
    large for it), said in one line; any other error keeps its traceback."""
    if not is_out_of_memory(e):
        return e
    if alone:
        return OutOfMemory(f"{run.label} seed {run.init_seed} ran out of GPU memory with no other run beside "
                           "it; it is resumable: lower train.batch_size and raise train.grad_accum by the "
                           "same factor (the same tokens per step), or use a GPU with more memory")
    return OutOfMemory(f"{run.label} seed {run.init_seed} ran out of GPU memory beside the other runs of "
                       "this compare; finished runs are recorded and this one is resumable: run compare "
                       "again with fewer --jobs (or --runs-per-gpu)")


def _run_parallel(plan: Plan, todo: list[PlannedRun], tally: _Tally, revision: str, progress: Progress, overall: TaskID,
                  stop_after_steps: int | None, eta: SuiteEta, launcher: Launcher,
                  downstream: _Downstream | None = None, session: Session | None = None) -> None:
    """Train several runs at once, each in its own process, as ``launcher`` starts them: a pool
    of ``--jobs`` workers, or a process per run pinned to its GPUs (``--gpus``).

    Small models leave a GPU mostly idle between kernel launches, so several runs side by side
    finish a suite sooner; each run is still exactly the run ``jobs=1`` would train (its own
    seeds, data order and directory). Each worker claims and records its run in the database
    (``_train_worker``) and dies with this process (``die_with_parent``); workers report progress
    through their metrics.jsonl, which is polled here for the progress bars.
    Downstream evaluations run in the worker that trained the run, as soon as it finishes
    (``_evaluate_in_worker``); what a finished run still lacks after that (its worker's
    evaluation failed, or the launcher runs it under torchrun) is evaluated in this process, one
    at a time, after the run's slot has gone to the next run (the bars pause meanwhile).
    A run that runs out of GPU memory beside the others lowers the pool's limit by one and goes
    back to the head of the queue (``PoolLauncher.shrink``); at a limit of one, a run that had
    company tries once alone. One that ran out alone, or any under ``--gpus``, ends the compare
    with one line (``_as_user_error``).
    """
    error: BaseException | None = None
    in_worker = downstream.job() if downstream is not None and launcher.evaluates_in_worker else None
    with launcher:
        pending: dict[cf.Future[RunEnd], tuple[PlannedRun, TaskID]] = {}
        company: dict[cf.Future[RunEnd], int] = {}  # the most other runs each had beside it
        queue = list(todo)

        def submit() -> None:
            while queue and error is None:
                run = queue[0]
                if not launcher.has_room():
                    return  # every slot busy: the next run waits for one to end
                if session is not None and not session.admit(plan, eta.rows, run):
                    queue.pop(0)  # held back for a later call (--max-runs / --time-budget)
                    continue
                fut = launcher.start(_job(plan, run, revision, stop_after_steps, in_worker))
                if fut is None:
                    return
                queue.pop(0)
                task = progress.add_task(f"{run.label} seed {run.init_seed}", total=run.steps, loss="-",
                                         tok_s="-")
                pending[fut] = (run, task)
                for f in pending:
                    company[f] = max(company.get(f, 0), len(pending) - 1)

        submit()
        while pending:
            done, _ = cf.wait(pending, timeout=2.0, return_when=cf.FIRST_COMPLETED)
            for fut, (run, task) in pending.items():
                if fut not in done:
                    rec = latest_train_record(plan.out_dir / RUNS_DIR / run.run_id)
                    if rec is not None:
                        progress.update(task, completed=rec["step"], loss=f"{rec['loss']:.3f}",
                                        tok_s=f"{rec['tokens_per_s']:,.0f}")
            evaluate: list[PlannedRun] = []
            for fut in done:
                run, task = pending.pop(fut)
                beside = company.pop(fut, 0)
                launcher.ended(fut)
                try:
                    end = fut.result()
                except BaseException as e:  # noqa: BLE001 - re-raised once the running runs end
                    progress.remove_task(task)
                    fewer = None
                    if is_out_of_memory(e) and error is None and isinstance(launcher, PoolLauncher):
                        # one fewer at once; already at one, a run that had company tries alone
                        fewer = launcher.shrink() or (launcher.jobs if beside else None)
                    if fewer is not None:
                        # Memory, not the run, was at fault: it resumes from its last checkpoint
                        # once a slot frees under the lower limit (ever lower, down to one run).
                        queue.insert(0, run)
                        eta.jobs = fewer
                        progress.console.print(
                            f"[yellow]{run.label} seed {run.init_seed} ran out of GPU memory beside "
                            f"{beside} other run(s)[/yellow]: from now on at most {fewer} at once; "
                            "it resumes from its last checkpoint when a slot frees", highlight=False)
                        continue
                    eta.ended(run, None)
                    error = error or _as_user_error(run, e, alone=beside == 0 and isinstance(launcher, PoolLauncher))
                    continue
                eta.ended(run, end.row)
                end_run(progress, overall, end.message, task)
                tally.add(run, end)
                if end.kind == "finished":
                    evaluate.append(run)
            if tally.interrupted is None:
                submit()  # no new run after one stopped short: the session is over
            for run in evaluate:
                if downstream is None or error is not None:
                    break  # left for the next compare, like an interrupted evaluation
                try:
                    downstream.evaluate(run, progress)
                except BaseException as e:  # noqa: BLE001 - re-raised once the running runs end
                    error = e
    if error is not None:
        raise error
