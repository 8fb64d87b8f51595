"""One run of ``archlab compare --gpus``, in its own process: ``python -m archlab.lab.worker``.

``compare`` starts this process with ``CUDA_VISIBLE_DEVICES`` set to the GPU(s) the run was
given (the environment is the only reliable way to pin a process to a GPU: it is read when CUDA
starts, so a process cannot move once it has used one; hence a fresh process per run). The
worker claims, trains and records the run itself, exactly like a ``--jobs`` pool worker
(``archlab.lab.runner._train_worker``), so the claim names the process that trains. A run on one
GPU trains in this process; a run on N > 1 GPUs is trained by ``archlab train`` under torchrun
(``archlab.lab.gpus.launch_command``), a child of this process, while this process holds the
claim and keeps its heartbeat, then reads the result from the run directory's metrics.jsonl.

Protocol: ``python -m archlab.lab.worker JOB_FILE RESULT_FILE PARENT_PID``. JOB_FILE is a pickle
of ``WorkerJob``; the worker writes RESULT_FILE (a pickle of the ``RunEnd``, or of the exception
that ended the run) atomically before it exits, and dies with PARENT_PID (``die_with_parent``).
``python -m archlab.lab.worker --exec-with-parent PID CMD...`` runs CMD in place of itself, set to
die with PID: how the torchrun child is kept from outliving its worker; its ranks are started with
``DIE_WITH_PARENT_ENV`` set, so each dies with torchrun's agent in turn.
"""

from __future__ import annotations

import os
import pickle
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archlab.errors import ArchlabError, TrainingDiverged

TORCHRUN_LOG = "torchrun.log"  # in the run directory: what torchrun and its ranks printed
LAUNCH_CONFIG = "launch.yaml"  # in the run directory: the run's config, as torchrun's ranks read it
# Set for torchrun's ranks: `archlab train` then dies with its parent (torchrun's agent, which dies
# with this worker, which dies with compare), so a kill -9 of compare leaves no rank training.
DIE_WITH_PARENT_ENV = "ARCHLAB_DIE_WITH_PARENT"


@dataclass(frozen=True)
class WorkerJob:
    db_path: Path
    job: Any  # archlab.lab.runner._Job
    train_fn: Any  # a TrainFn (tests) or None (the real trainer)
    gpus_per_run: int


def _write_atomic(path: Path, value: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    os.replace(tmp, path)


def torchrun_train(cfg: Any, out: Path, nproc: int) -> Any:
    """Train ``cfg`` into ``out`` on ``nproc`` GPUs under torchrun and return a ``TrainResult``
    read from the run directory (rank 0's metrics.jsonl: the curves, the throughput it logged)."""
    from archlab.config import dump_yaml
    from archlab.io import checkpoint as ckpt_io
    from archlab.lab.gpus import launch_command
    from archlab.model.accounting import param_counts
    from archlab.train.trainer import TrainResult, read_curves

    out.mkdir(parents=True, exist_ok=True)
    ckpt_io.atomic_write_text(out / LAUNCH_CONFIG, dump_yaml(cfg))
    cmd = launch_command(out / LAUNCH_CONFIG, out, nproc)
    t0 = time.perf_counter()
    with open(out / TORCHRUN_LOG, "ab") as log:
        rc = subprocess.run([sys.executable, "-m", "archlab.lab.worker", "--exec-with-parent",
                             str(os.getpid()), *cmd], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, DIE_WITH_PARENT_ENV: "1"}).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        # archlab train prints a divergence as one line "archlab: training diverged: ..."; under
        # torchrun it reaches only the log, so it is found there: a diverged run is a result.
        lines = (out / TORCHRUN_LOG).read_text(errors="replace").splitlines()
        diverged = [ln for ln in lines if "training diverged:" in ln]
        if diverged:
            raise TrainingDiverged("training diverged: " + diverged[-1].split("training diverged:", 1)[1].strip())
        raise ArchlabError(f"torchrun training {out.name} on {nproc} GPUs exited with {rc}; "
                           f"see {out / TORCHRUN_LOG}")
    train_curve, val_curve = read_curves(out)
    if not val_curve:
        raise ArchlabError(f"torchrun training {out.name} finished without a validation record in "
                           f"{out / 'metrics.jsonl'}")
    last = val_curve[-1]
    rates = [float(r["tokens_per_s"]) for r in train_curve if r.get("tokens_per_s")]
    mfus = [float(r["mfu"]) for r in train_curve if r.get("mfu")]
    return TrainResult(final_val_loss=float(last["loss"]), final_val_bpb=float(last["bpb"]),
                       val_curve=val_curve, train_curve=train_curve, tokens=int(last["tokens"]),
                       steps=int(last["step"]), tokens_per_s=statistics.fmean(rates) if rates else 0.0,
                       wall_s=wall, device=f"{nproc} GPUs (torchrun)",
                       mfu=statistics.fmean(mfus) if mfus else None,
                       params=param_counts(cfg.model)["params_total"])


def run_worker(w: WorkerJob) -> Any:
    """Claim, train and record one run (the ``RunEnd``)."""
    from archlab.lab.runner import _train_claimed, _train_worker
    from archlab.lab.store import ResultStore

    if w.gpus_per_run == 1:
        return _train_worker(w.db_path, w.job, w.train_fn)
    if w.job.stop_after_steps is not None:
        raise ArchlabError("stop_after_steps is not supported for runs on several GPUs (archlab train has "
                           "no such option)")
    with ResultStore(w.db_path) as store:
        return _train_claimed(store, w.job, lambda cfg, out: torchrun_train(cfg, out, w.gpus_per_run))


def main(argv: list[str]) -> int:
    from archlab.lab.store.owner import die_with_parent

    if argv[:1] == ["--exec-with-parent"]:
        die_with_parent(int(argv[1]))  # PR_SET_PDEATHSIG survives exec; the watcher thread does not
        os.execvp(argv[2], argv[2:])
    job_file, result_file, parent = Path(argv[0]), Path(argv[1]), int(argv[2])
    die_with_parent(parent)
    with open(job_file, "rb") as f:
        w: WorkerJob = pickle.load(f)
    try:
        end = run_worker(w)
    except BaseException as e:  # noqa: BLE001 - handed to compare, which raises it
        try:
            _write_atomic(result_file, e)
        except Exception:  # noqa: BLE001 - not picklable: the message still gets there
            _write_atomic(result_file, ArchlabError(f"{type(e).__name__}: {e}"))
        return 1
    _write_atomic(result_file, end)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
