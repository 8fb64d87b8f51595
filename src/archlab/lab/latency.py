"""Measured inference cost in a suite: prefill and decode latency of each variant on the engine.

The cost columns a suite computes (FLOPs, bytes per decode step) say what a variant should cost;
this module records what it does cost on the engine ``archlab serve`` runs
(``archlab.infer.bench``): the median ms of a prefill of a ``costs.prompt``-token prompt at batch
1, and the median ms of one decode step at each batch of ``costs.batches`` with ``costs.context``
tokens in the cache, each timed with CUDA events after warm-up (wall clock on CPU).

Choices, and why:

* **One run per variant.** Latency depends on the architecture and the shape, not on the seed
  (the weights' values change no kernel), so each label is measured once, on its first finished
  seed in plan order (the next seed when that one's checkpoint is gone). Measuring every seed
  would multiply the compile and capture time by the seeds for no information.
* **After training, in the suite's own process, one variant after another.** Timings taken while
  other runs train on the same device measure the contention, not the variant. So the
  measurements run at the end of ``run_suite`` (after every run of the call has finished, in the
  parent when ``--jobs`` trains in workers), sequentially, and only when no other process is
  training a run on this host (a live run claim); otherwise they are left to the next
  ``compare``. A suite-wide claim (``LATENCY_KEY``) keeps two compares from measuring at once.
  All variants measured in one pass share a ``session`` id: their ratios to the baseline are
  "measured in the same run" (METHODOLOGY.md); the report marks ratios across sessions.
* **Resumable.** A measurement is stored per (run, phase, batch, requested length) in the
  ``latency`` table; what a suite's labels lack for its current ``costs`` (a suite finished before
  ``measure`` was set, a new batch size, a pass interrupted by a kill) is measured on the next
  ``compare`` without retraining, and nothing recorded is measured again.
* **Shapes that do not fit.** A prefill needs ``prompt`` positions and a decode measurement
  ``context + steps + DECODE_MARGIN`` (``bench_decode``'s warm-up steps advance the positions
  too). A model whose ``max_seq_len`` is smaller is measured at the largest shape that fits:
  the prompt is cut to ``max_seq_len``; the timed decode steps shrink first (down to
  ``MIN_STEPS``), then the context (``fit_decode``). Both the requested and the measured length
  are stored, and the report names every shape measured smaller than asked.
* **Which device.** ``costs.measure: auto`` measures runs whose ``train.device`` resolves to CUDA,
  on that device; ``always`` measures on the runs' device whatever it is (on CPU the timings are
  wall clock, and labelled so); ``never`` measures nothing. The dtype is the engine's default
  (``archlab.infer.loading``: bfloat16 on CUDA, float32 on CPU) and is stored with each row.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from archlab.errors import ArchlabError, CheckpointError
from archlab.lab.store.owner import Owner
from archlab.lab.store import LATENCY_KEY, Heartbeat, LatencyRow, ResultStore

if TYPE_CHECKING:
    from rich.console import Console

    from archlab.config import RunConfig
    from archlab.lab.plan import Plan, PlannedRun
    from archlab.lab.suite import CostSpec

DECODE_MARGIN = 16  # positions bench_decode's engine keeps beyond context + steps (its warm-up)
MIN_STEPS = 32  # timed decode steps are cut down to this before the context is
PREFILL_REPS = 10  # timed prefills (bench_prefill's default)

Phase = Literal["prefill", "decode"]


@dataclass(frozen=True)
class Shape:
    """One measurement: what the suite asked for (``requested``) and what fits (``length``)."""

    phase: Phase
    batch: int
    requested: int  # prompt tokens (prefill) or tokens in the cache (decode), as the suite asks
    length: int  # as measured
    steps: int  # timed repetitions (prefill) or decode steps

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.phase, self.batch, self.requested)

    def describe(self) -> str:
        what = f"prompt {self.length}" if self.phase == "prefill" else f"context {self.length}"
        return f"{self.phase} batch {self.batch}, {what}"


def fit_decode(context: int, steps: int, max_seq_len: int) -> tuple[int, int] | None:
    """(context, timed steps) of a decode measurement that fits ``max_seq_len`` positions: as asked
    when it fits; else fewer steps (down to ``MIN_STEPS``, and to half the room at most), then a
    shorter context. None when the model has no room at all (``max_seq_len <= DECODE_MARGIN + 1``)."""
    room = max_seq_len - DECODE_MARGIN
    if room < 2:
        return None
    if context + steps <= room:
        return context, steps
    s = min(steps, max(MIN_STEPS, room - context))
    s = max(1, min(s, room // 2))
    return min(context, room - s), s


def shapes_for(spec: CostSpec, context: int, max_seq_len: int) -> list[Shape]:
    """Every measurement ``spec`` asks of a model with ``max_seq_len`` positions, decode at
    ``context`` (the run's cost context: ``costs.context`` or ``train.seq_len``)."""
    shapes = [Shape("prefill", 1, spec.prompt, min(spec.prompt, max_seq_len), PREFILL_REPS)]
    fit = fit_decode(context, spec.steps, max_seq_len)
    if fit is not None:
        shapes += [Shape("decode", b, context, fit[0], fit[1]) for b in spec.batches]
    return shapes


@dataclass(frozen=True)
class Timing:
    shape: Shape
    ms: float  # median: one prefill call, or one decode step of the whole batch
    mfu: float | None = None  # prefill
    roofline_ms: float | None = None  # decode


@dataclass(frozen=True)
class Measured:
    """What ``MeasureFn`` returns: the timings of one checkpoint and where they were taken."""

    device: str  # archlab.io.device.device_name
    dtype: str
    timer: Literal["cuda-events", "wall-clock"]
    bandwidth: float | None  # measured copy bandwidth, bytes/s (None on CPU)
    timings: list[Timing] = field(default_factory=list)


class MeasureFn(Protocol):
    """Latency of the final checkpoint in ``run_dir`` at ``shapes`` on ``device``."""

    def __call__(self, run_dir: Path, cfg: RunConfig, shapes: list[Shape], *, device: str) -> Measured: ...


def measure_run(run_dir: Path, cfg: RunConfig, shapes: list[Shape], *, device: str) -> Measured:
    """The real ``MeasureFn``: ``archlab bench`` on the run's final checkpoint
    (``load_for_inference``, the engine's default dtype), one engine per shape as ``bench_*``
    build them."""
    import torch

    from archlab.infer.bench import bench_decode, bench_prefill, copy_bandwidth
    from archlab.infer.loading import load_for_inference
    from archlab.io.device import device_name

    dev = torch.device(device)
    if dev.type == "cuda":
        import torch._dynamo

        # Fresh compile caches for each variant: dynamo caches every engine's graphs under the same
        # functions, and past its cache limit a function would silently run eager.
        torch._dynamo.reset()
    model, _, _, _ = load_for_inference(run_dir, device, "auto")
    try:
        bandwidth = copy_bandwidth(dev)
        timings = []
        with torch.no_grad():
            for s in shapes:
                if s.phase == "prefill":
                    p = bench_prefill(model, s.length, batch=s.batch, reps=s.steps)
                    timings.append(Timing(s, p.ms, mfu=p.mfu))
                else:
                    d = bench_decode(model, s.batch, s.length, s.steps, bandwidth)
                    timings.append(Timing(s, d.ms_per_step, roofline_ms=d.roofline_ms))
        dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
        return Measured(device=device_name(dev), dtype=dtype,
                        timer="cuda-events" if dev.type == "cuda" else "wall-clock",
                        bandwidth=bandwidth if bandwidth == bandwidth else None, timings=timings)
    finally:
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def fmt_ms(ms: float) -> str:
    """Milliseconds at a useful precision: ``0.812``, ``3.45``, ``12.3``, ``153``."""
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}"


# ---- the suite's measuring pass ------------------------------------------------------------------
@dataclass
class _Work:
    label: str
    candidates: list[PlannedRun]  # finished runs of the label, the one to measure first
    shapes: list[Shape]  # what it lacks
    device: str


class Latency:
    """The measurements a suite's labels lack, and the pass that takes them."""

    def __init__(self, plan: Plan, store: ResultStore, measure_fn: MeasureFn | None, console: Console) -> None:
        self.plan, self.store, self.console = plan, store, console
        self.measure_fn = measure_fn or measure_run
        self.spec = plan.suite.costs

    def work(self, runs: list[PlannedRun]) -> list[_Work]:
        """Per label of ``runs`` with a finished run on a device the suite measures: the shapes it
        lacks, to be measured on the run that already has some (so one label's figures come from
        one checkpoint), else on its first finished seed."""
        if self.spec.measure == "never":
            return []
        from archlab.io.device import resolve_device

        have: dict[str, set[tuple[str, int, int]]] = {}
        for row in self.store.latency():
            have.setdefault(row.run_id, set()).add(row.shape)
        out = []
        for label in dict.fromkeys(r.label for r in runs):
            finished = [r for r in self.plan.runs if r.label == label and _finished(self.store, r.run_id)]
            if not finished:
                continue
            first = finished[0]
            try:
                dev = resolve_device(first.config.train.device)
            except ArchlabError as e:  # a CUDA suite read on a machine without CUDA
                if self.spec.measure == "always":
                    self.console.print(f"[yellow]{label}: latency not measured[/yellow]: {e}", highlight=False)
                continue
            if not self.spec.measures_on(dev.type):
                continue
            wanted = shapes_for(self.spec, first.cost_context, first.config.model.max_seq_len)
            measured = [r for r in finished if have.get(r.run_id)]
            got = have.get(measured[0].run_id, set()) if measured else set()
            missing = [s for s in wanted if s.key not in got]
            if missing:
                order = measured[:1] + [r for r in finished if r not in measured[:1]]
                out.append(_Work(label, order, missing, str(dev)))
        return out

    def run(self, runs: list[PlannedRun], revision: str) -> int:
        """Measure what the labels of ``runs`` lack; the number of labels measured. Nothing is
        measured while another process trains on this host, or measures this suite."""
        if not self.work(runs):
            return 0
        training = self.store.runs_on_host()
        if training:
            self.console.print(f"latency: {training} run(s) training on this host now; measuring later "
                               "(next compare), not under their load", highlight=False)
            return 0
        owner = Owner.current()
        got = self.store.claim(LATENCY_KEY, owner)
        if got.state == "busy":
            assert got.holder is not None
            self.console.print(f"latency: being measured by {got.holder.describe()}; skipping it", highlight=False)
            return 0
        try:
            with Heartbeat(self.store.path, owner):
                todo = self.work(runs)  # again, now that the claim is ours
                session = uuid.uuid4().hex[:12]
                self.console.print(f"measuring latency of {len(todo)} variant(s) on the engine, one after another",
                                   highlight=False)
                return sum(self._measure(w, session, revision) for w in todo)
        finally:
            try:
                self.store.release(LATENCY_KEY, owner)
            except Exception:  # noqa: BLE001 - the claim goes stale with this process anyway
                pass

    def _measure(self, w: _Work, session: str, revision: str) -> bool:
        from archlab.lab.display import RUNS_DIR

        errors = []
        for run in w.candidates:
            try:
                m = self.measure_fn(self.plan.out_dir / RUNS_DIR / run.run_id, run.config, w.shapes, device=w.device)
            except CheckpointError as e:  # run directory deleted to save space: the next seed
                errors.append(str(e))
                continue
            except Exception as e:  # noqa: BLE001 - the training results stand; the next compare retries
                self.console.print(f"[red]{w.label} seed {run.init_seed}: latency measurement failed[/red]: "
                                   f"{e.__class__.__name__}: {e}", highlight=False)
                return False
            now = time.time()
            rows = [LatencyRow(run_id=run.run_id, phase=t.shape.phase, batch=t.shape.batch,
                               requested=t.shape.requested, length=t.shape.length,
                               max_seq_len=run.config.model.max_seq_len, steps=t.shape.steps, ms=t.ms,
                               timer=m.timer, device=m.device, dtype=m.dtype, mfu=t.mfu,
                               roofline_ms=t.roofline_ms, bandwidth=m.bandwidth, session=session,
                               code_revision=revision, measured_at=now) for t in m.timings]
            if {r.shape for r in rows} != {s.key for s in w.shapes}:
                raise RuntimeError(f"latency measurement of {run.run_id} returned shapes "
                                   f"{sorted(r.shape for r in rows)}, expected {sorted(s.key for s in w.shapes)}")
            self.store.add_latency(rows)
            parts = "; ".join(f"{t.shape.describe()}: {fmt_ms(t.ms)} ms" for t in m.timings)
            self.console.print(f"{w.label} seed {run.init_seed} latency ({m.device}, {m.dtype}, {m.timer}): {parts}",
                               highlight=False)
            return True
        self.console.print(f"[yellow]{w.label}: latency not measured[/yellow]: no checkpoint "
                           f"({'; '.join(errors)})", highlight=False)
        return False


def _finished(store: ResultStore, run_id: str) -> bool:
    row = store.get(run_id)
    return row is not None and row.status == "finished"
