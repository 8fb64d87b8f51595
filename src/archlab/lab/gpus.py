"""Placing a suite's runs on GPUs: ``archlab compare --gpus 0,1 --runs-per-gpu K --gpus-per-run N``.

The runs of a suite are independent, so they spread over GPUs without any communication: each
run is trained by its own process, started with ``CUDA_VISIBLE_DEVICES`` naming the GPU(s) it was
given, so inside it the run's ``train.device: cuda`` (or ``auto``) is ``cuda:0`` = its own GPU.

* ``--runs-per-gpu K``: a GPU has K *slots*; a run occupies one slot on each GPU it uses. Small
  models leave a GPU mostly idle between kernel launches, so several runs side by side finish a
  suite sooner; the limit is memory (K runs' weights, optimizer state and activations must fit)
  and, past the point where the GPU is busy, nothing more is gained. A slot count is never
  exceeded: that is the whole contract of ``GpuSlots``.
* ``--gpus-per-run N`` (N > 1): a run gets N distinct GPUs and is launched under torchrun
  (``launch_command``) for the trainer's data/model parallelism (``train.parallel``). Every run of
  the suite needs the same N, so the concurrency is ``len(gpus) * K // N``.

Nothing here touches CUDA: the device list is given (``parse_gpus``'s ``visible``), so the
placement is tested on machines without GPUs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from archlab.errors import ConfigError


@dataclass(frozen=True)
class GpuPlan:
    """How ``compare`` places runs: GPU indices as this process sees them, slots per GPU, GPUs per run."""

    gpus: tuple[int, ...]
    runs_per_gpu: int = 1
    gpus_per_run: int = 1

    def __post_init__(self) -> None:
        if not self.gpus:
            raise ConfigError("--gpus names no GPU")
        if len(set(self.gpus)) != len(self.gpus):
            raise ConfigError(f"--gpus names a GPU twice: {','.join(map(str, self.gpus))}")
        if self.runs_per_gpu < 1 or self.gpus_per_run < 1:
            raise ConfigError("--runs-per-gpu and --gpus-per-run must be at least 1")
        if self.gpus_per_run > len(self.gpus):
            raise ConfigError(f"--gpus-per-run {self.gpus_per_run} needs at least that many GPUs; "
                              f"--gpus gives {len(self.gpus)}")

    @property
    def concurrency(self) -> int:
        """How many runs train at once when every slot is used."""
        return len(self.gpus) * self.runs_per_gpu // self.gpus_per_run


def parse_gpus(spec: str, visible: int) -> tuple[int, ...]:
    """``--gpus``: ``all`` (every one of the ``visible`` CUDA devices) or comma-separated indices
    (``0,1``) among them. Indices are as this process sees them, i.e. already relative to any
    ``CUDA_VISIBLE_DEVICES`` it was started with (``child_visible_devices`` maps them back)."""
    spec = spec.strip()
    if visible < 1:
        raise ConfigError(f"--gpus {spec}: no CUDA device is visible to this process")
    if spec == "all":
        return tuple(range(visible))
    ids: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ConfigError(f"--gpus {spec!r}: expected 'all' or GPU indices like 0,1 (got {part!r})")
        gpu = int(part)
        if gpu >= visible:
            raise ConfigError(f"--gpus {spec}: GPU {gpu} does not exist; this process sees {visible} "
                              f"(indices 0 to {visible - 1})")
        ids.append(gpu)
    return tuple(ids)


def visible_gpu_count() -> int:
    """How many CUDA devices this process sees (0 without CUDA). torch answers without creating a
    CUDA context, so the spawned workers are free to pick their own devices."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def child_visible_devices(gpus: tuple[int, ...], env: Mapping[str, str] | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a worker given ``gpus``: when this process was itself started
    with ``CUDA_VISIBLE_DEVICES=2,3``, its GPU 0 is the machine's GPU 2, and the worker must be
    told ``2`` (entries may be UUIDs or MIG names: they are passed on as written)."""
    env = os.environ if env is None else env
    outer = env.get("CUDA_VISIBLE_DEVICES")
    if outer is None or not outer.strip():
        return ",".join(map(str, gpus))
    entries = [e.strip() for e in outer.split(",") if e.strip()]
    if max(gpus) >= len(entries):
        raise ConfigError(f"GPU {max(gpus)} is not among CUDA_VISIBLE_DEVICES={outer}")
    return ",".join(entries[g] for g in gpus)


@dataclass
class GpuSlots:
    """The free slots of each GPU of a ``GpuPlan``; ``take`` hands out GPUs, ``give`` takes them back."""

    plan: GpuPlan
    used: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.used = {g: 0 for g in self.plan.gpus}

    def take(self) -> tuple[int, ...] | None:
        """GPUs for one more run, or None while too few have a free slot (wait for a run to end).
        The least used GPUs first (ties in the order --gpus names them), so runs spread over all
        GPUs before any GPU gets a second: with fewer runs than GPUs, each runs alone."""
        free = [g for g in self.plan.gpus if self.used[g] < self.plan.runs_per_gpu]
        if len(free) < self.plan.gpus_per_run:
            return None
        order = {g: i for i, g in enumerate(self.plan.gpus)}
        chosen = sorted(free, key=lambda g: (self.used[g], order[g]))[:self.plan.gpus_per_run]
        for g in chosen:
            self.used[g] += 1
        return tuple(sorted(chosen, key=order.__getitem__))

    def give(self, gpus: tuple[int, ...]) -> None:
        for g in gpus:
            if self.used.get(g, 0) < 1:
                raise RuntimeError(f"GPU {g} given back more often than taken")  # a scheduler bug
            self.used[g] -= 1


def launch_command(config_file: Path, run_dir: Path, nproc: int, python: str | None = None) -> list[str]:
    """The command a run on ``nproc`` GPUs is trained by: ``archlab train`` under torchrun, one
    process per GPU (``--standalone``: a rendezvous on a free local port, so several such runs
    can share a host), resuming from the run directory's checkpoints like every lab run."""
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", "archlab.cli", "train", "--config", str(config_file),
            "--out", str(run_dir), "--resume", "auto"]
