"""Number formatting shared by the plan table and the reports (one style everywhere)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from archlab.lab.store import LatencyRow


def si(x: float | None, unit: str = "") -> str:
    """``1840000 -> '1.84M'``, ``2048, 'B' -> '2.05kB'``; ``-`` for a missing value."""
    if x is None or not math.isfinite(x):
        return "-"
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{prefix}{unit}"
    return f"{x:.3g}{unit}"


def duration(seconds: float) -> str:
    """``95 -> '1m35s'``, ``4000 -> '1h06m'``."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def clock(seconds: float) -> str:
    """``h:mm:ss``, as rich shows times left: ``95 -> '0:01:35'``."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1, 'seed' -> '1 seed'``, ``3, 'seed' -> '3 seeds'`` (``nouns``: an irregular plural)."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


_CPU_DEVICE = re.compile(r"^cpu \((?P<arch>[^,()]+), (?P<threads>\d+) threads?\)$")


def device_text(device: str) -> str:
    """A trainer's device name as a person reads it: ``cpu (x86_64, 2 threads)`` (torch's CPU
    threads per run) becomes ``cpu (x86_64), 2 threads``, pluralised; GPU names as they are."""
    m = _CPU_DEVICE.match(device)
    if m is None:
        return device
    return f"cpu ({m['arch']}), {plural(int(m['threads']), 'thread')} per run"


def latency_device_text(row: "LatencyRow") -> str:
    """Where and how a latency was timed: ``NVIDIA H200, bfloat16, CUDA events`` or
    ``cpu (x86_64), 2 threads, float32, CPU wall clock``."""
    m = _CPU_DEVICE.match(row.device)
    device = row.device if m is None else f"cpu ({m['arch']}), {plural(int(m['threads']), 'thread')}"
    timer = "CUDA events" if row.timer == "cuda-events" else "CPU wall clock"
    return f"{device}, {row.dtype}, {timer}"


def is_gpu(device: str | None) -> bool:
    """Whether a trainer's device name is an accelerator: CPU names contain ``cpu`` (the trainer's
    ``cpu (arch, N threads)``, tests' ``fake-cpu``); CUDA devices are named by their card."""
    return bool(device) and "cpu" not in str(device).lower()


def device_hours(device: str | None, wall_s: float | None) -> float:
    """GPU-hours of one run: its wall time on a GPU (one device per run), none on a CPU."""
    return (wall_s or 0.0) / 3600.0 if is_gpu(device) else 0.0
