"""How ``archlab compare`` starts the runs it trains side by side (``archlab.lab.runner``):
a pool of ``--jobs`` spawned workers, or a fresh process per run pinned to its GPUs
(``--gpus``). A launcher starts a job when it has room and takes the slot back when it ends."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from archlab.errors import ArchlabError
from archlab.lab.store.owner import die_with_parent
from archlab.lab.display import is_done
from archlab.lab.gpus import GpuPlan, GpuSlots, child_visible_devices
from archlab.lab.store import ResultStore

# How long a worker sent SIGTERM may take to end before it is killed: a training run finishes its
# step and saves a checkpoint at it first (archlab.train.trainer._StopRequest), and twenty runs
# writing their weights and optimizer state at once can take tens of seconds on a slow disk.
_STOP_WAIT_S = 90.0


class PoolLauncher:
    """``--jobs N``: a pool of N spawned worker processes, reused from run to run."""

    #: a worker evaluates the run it trained on the suite's downstream tasks (runner._evaluate_in_worker)
    evaluates_in_worker = True

    def __init__(self, jobs: int, db_path: Path, train_fn: Any, worker: Callable[..., Any]) -> None:
        self.jobs, self.db_path, self.train_fn, self.worker = jobs, db_path, train_fn, worker
        self.running = 0
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        # Workers are spawned by pool.submit in this (the main) thread, and none is replaced while
        # the pool runs (no max_tasks_per_child): PR_SET_PDEATHSIG fires when the spawning *thread*
        # ends.
        self.pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=die_with_parent,
                                           initargs=(os.getpid(),))

    def start(self, job: Any) -> "cf.Future[Any] | None":
        if self.running >= self.jobs:
            return None
        self.running += 1
        return self.pool.submit(self.worker, self.db_path, job, self.train_fn)

    def has_room(self) -> bool:
        return self.running < self.jobs

    def shrink(self) -> int | None:
        """One run fewer at once from now on (a run ran out of GPU memory beside the others):
        the new limit, or None when it is already one run."""
        if self.jobs <= 1:
            return None
        self.jobs -= 1
        return self.jobs

    def ended(self, fut: "cf.Future[Any]") -> None:
        self.running -= 1

    def __enter__(self) -> "PoolLauncher":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            self._stop_workers()
        self.pool.shutdown(wait=True, cancel_futures=exc_type is not None)

    def _stop_workers(self) -> None:
        """Leaving on an error or a signal (Ctrl-C, SIGTERM): end the workers now rather than wait
        for their runs to finish, which may take hours. A run in training saves a checkpoint at
        its current step and leaves; one killed after ``_STOP_WAIT_S`` is left as a kill leaves it:
        its checkpoints intact and its claim taken over by the next compare."""
        # ProcessPoolExecutor names its workers only privately before Python 3.14's terminate_workers
        workers = list((getattr(self.pool, "_processes", None) or {}).values())
        # A worker whose run stops goes back to waiting for the next job, and the signal that
        # stopped it is spent: shutting the pool down first sends it the sentinel that ends it.
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in workers:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + _STOP_WAIT_S  # one wait for them all, not one per worker
        for proc in workers:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()


class GpuLauncher:
    """``--gpus``: one fresh process per run (``python -m archlab.lab.worker``), started with
    ``CUDA_VISIBLE_DEVICES`` naming the GPUs ``GpuSlots`` gave it, which get them back when it
    ends. A process per run, not a pool: CUDA reads that variable once, when it starts in a
    process, so a process that has trained on one GPU cannot train the next run on another."""


    #: a one-GPU run's worker evaluates it (runner._evaluate_in_worker); a run under torchrun is
    #: evaluated by compare
    evaluates_in_worker = True

    def __init__(self, gpus: GpuPlan, store: ResultStore, out_dir: Path, train_fn: Any) -> None:
        self.gpus, self.store, self.db_path, self.train_fn = gpus, store, store.path, train_fn
        self.slots = GpuSlots(gpus)
        # The job and result files are pickles (a job holds the run's config and, in tests, a
        # function): they live in a private directory of this process (mode 0700), never in the
        # suite directory, which other users or machines may write to.
        self.work = Path(tempfile.mkdtemp(prefix="archlab-workers-"))
        self.held: dict[cf.Future[Any], tuple[tuple[int, ...], subprocess.Popen[bytes] | None, Path | None]] = {}

    def _elsewhere(self, job: Any) -> Any:
        """The run's end when another process has recorded it or holds it now. Only to spare a
        worker's start (seconds of imports) and a GPU slot: the worker's claim is what decides."""
        from archlab.lab.runner import RunEnd  # the runner imports this module

        name = f"{job.run.label} seed {job.run.init_seed}"
        if is_done(self.store.get(job.run.run_id)):
            return RunEnd("done", f"{name}: recorded by another process meanwhile; skipping it")
        claim = self.store.claims().get(job.run.run_id)
        if claim is not None and claim.alive():
            return RunEnd("busy", f"{name}: being trained by {claim.owner.describe()}; skipping it")
        return None

    def has_room(self) -> bool:
        gpus = self.slots.take()
        if gpus is None:
            return False
        self.slots.give(gpus)
        return True

    def start(self, job: Any) -> "cf.Future[Any] | None":
        from archlab.lab.worker import WorkerJob

        end = self._elsewhere(job)
        if end is not None:
            done: cf.Future[Any] = cf.Future()
            done.set_result(end)
            self.held[done] = ((), None, None)
            return done
        gpus = self.slots.take()
        if gpus is None:
            return None
        # Unique per attempt: a worker of an earlier compare, killed, may have left its files.
        files = self.work / f"{job.run.run_id}.{os.getpid()}"
        files.mkdir(parents=True, exist_ok=True)
        job_file, result_file = files / "job.pickle", files / "result.pickle"
        result_file.unlink(missing_ok=True)
        with open(job_file, "wb") as f:
            pickle.dump(WorkerJob(self.db_path, job, self.train_fn, self.gpus.gpus_per_run), f)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=child_visible_devices(gpus),
                   # what multiprocessing's spawn does for --jobs workers: the same imports as here
                   PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        # Started from this (the main) thread: the worker's PR_SET_PDEATHSIG is tied to it.
        proc = subprocess.Popen([sys.executable, "-m", "archlab.lab.worker", str(job_file), str(result_file),
                                 str(os.getpid())], env=env, stdin=subprocess.DEVNULL)
        fut: cf.Future[Any] = cf.Future()
        self.held[fut] = (gpus, proc, files)
        threading.Thread(target=self._wait, args=(proc, result_file, job.run.run_id, fut),
                         name=f"archlab-worker-{proc.pid}", daemon=True).start()
        return fut

    @staticmethod
    def _wait(proc: subprocess.Popen[bytes], result_file: Path, run_id: str, fut: cf.Future[Any]) -> None:
        rc = proc.wait()
        try:
            with open(result_file, "rb") as f:
                value = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            fut.set_exception(ArchlabError(f"the worker process training {run_id} exited with {rc} and "
                                           "left no result (killed?); the run is resumable"))
            return
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)

    def ended(self, fut: "cf.Future[Any]") -> None:
        gpus, _proc, files = self.held.pop(fut)
        self.slots.give(gpus)
        if files is None:
            return
        for name in ("job.pickle", "result.pickle"):
            (files / name).unlink(missing_ok=True)
        try:
            files.rmdir()
        except OSError:
            pass

    def __enter__(self) -> "GpuLauncher":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        procs = [proc for _gpus, proc, _files in self.held.values() if proc is not None]
        if exc_type is not None:  # an error or a signal: stop the runs now, as PoolLauncher does
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()  # the worker's torchrun child dies with it (die_with_parent)
        deadline = time.monotonic() + _STOP_WAIT_S
        for proc in procs:  # like a pool's shutdown(wait=True)
            try:
                proc.wait(timeout=None if exc_type is None else max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)


Launcher = PoolLauncher | GpuLauncher
