"""Stand-ins for the trainer, the cost model and data preparation, so lab tests run in seconds.

The fake trainer behaves like the real one where the lab depends on it: it checkpoints into
``out_dir/ckpt/`` every ``ckpt_every`` steps, resumes from the latest checkpoint, honours
``stop_after_steps`` and returns a ``TrainResult``-shaped object. Its losses are a pure function
of (config, step), so an interrupted-and-resumed run gives exactly the uninterrupted result.
The loss depends on ``model.init_std`` (lower is better), which lets tests build a variant with a
known effect without the lab knowing anything about it.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

from archlab.config import ModelConfig, RunConfig
from archlab.errors import CheckpointError, TrainingDiverged
from archlab.train.trainer import TrainResult


def FakeResult(**kw: Any) -> TrainResult:
    """The trainer's own result type, on the fake device."""
    return TrainResult(**{"device": "fake-cpu", **kw})


FINAL_SAMPLE_SHIFT = -0.0025  # the fake final evaluation's loss minus the curve's last


def fake_loss(cfg: RunConfig, step: int) -> float:
    """Loss at ``step``: a decaying curve to a level set by init_std, plus per-run noise."""
    rng = random.Random(cfg.hash())
    level = 3.0 + 10.0 * (cfg.model.init_std - 0.02) + rng.gauss(0.0, 0.01)
    return level + 4.0 * math.exp(-step / max(1.0, cfg.train.steps / 5))


def fake_batches(cfg: RunConfig, loss: float) -> list[list[float]]:
    """The final sample's per-batch [nats, tokens]: 4 batches of 100 tokens whose losses differ by
    batch (the same for every run: a hard batch is hard for every model) and a little by run."""
    rng = random.Random(cfg.hash() + "/batches")
    shifts = [-0.3, 0.1, 0.5, -0.3]
    return [[100 * (loss + sh + rng.gauss(0.0, 0.002)), 100] for sh in shifts]


class FakeTrainer:
    """Callable with ``train``'s signature; records every call as (run directory name, first step),
    and with ``log`` appends ``[name, first step, pid]`` to that file (shared by processes).

    ``hang_at=(name_prefix, step)``: in the runs whose directory name starts with the prefix (""
    for every run), after the checkpoint at ``step``, append "name pid" to ``hang_marker`` and
    sleep (a test then kills the process). ``diverge``: labels whose runs raise
    ``TrainingDiverged``. ``hold_until``: every run waits, once logged, until that file exists
    (a test's gate). ``step_delay``: seconds per step, for runs that overlap in time.
    """

    def __init__(self, log: Path | None = None, hang_at: tuple[str, int] | None = None,
                 hang_marker: Path | None = None, diverge: tuple[str, ...] = (),
                 hold_until: Path | None = None, step_delay: float = 0.0) -> None:
        self.log, self.hang_at, self.hang_marker, self.diverge = log, hang_at, hang_marker, diverge
        self.hold_until, self.step_delay = hold_until, step_delay
        self.calls: list[tuple[str, int]] = []

    def __call__(self, cfg: RunConfig, out_dir: Path, *, resume: bool = True, progress: Any = None,
                 stop_after_steps: int | None = None) -> FakeResult:
        out = Path(out_dir)
        ckpt = out / "ckpt"
        tc = cfg.train
        step, val, train = 0, [], []
        if resume and (ckpt / "latest").exists():
            state = json.loads((ckpt / (ckpt / "latest").read_text().strip() / "state.json").read_text())
            step, val, train = state["step"], state["val"], state["train"]
        self.calls.append((out.name, step))
        if self.log is not None:
            with open(self.log, "a") as f:  # one short append: whole lines even with several writers
                f.write(json.dumps([out.name, step, os.getpid()]) + "\n")
        while self.hold_until is not None and not self.hold_until.exists():
            time.sleep(0.02)
        if any(out.name.startswith(f"{label}-") for label in self.diverge):
            raise TrainingDiverged(f"training diverged: loss is nan at step {step}")
        task = progress.add_task(out.name, total=tc.steps, completed=step) if progress is not None else None
        t0, done = time.perf_counter(), 0
        while step < tc.steps and (stop_after_steps is None or done < stop_after_steps):
            step += 1
            done += 1
            if self.step_delay:
                time.sleep(self.step_delay)
            tokens = step * tc.tokens_per_step
            if step % tc.log_every == 0 or step == tc.steps:
                train.append({"step": step, "tokens": tokens, "loss": fake_loss(cfg, step) + 0.05})
            if step % tc.eval_every == 0 or step == tc.steps:
                loss = fake_loss(cfg, step)
                val.append({"step": step, "tokens": tokens, "loss": loss, "bpb": loss / math.log(2) / 3.5})
            if step % tc.ckpt_every == 0 or step == tc.steps:
                name = f"step_{step:07d}"
                (ckpt / name).mkdir(parents=True, exist_ok=True)
                (ckpt / name / "state.json").write_text(json.dumps({"step": step, "val": val, "train": train}))
                (ckpt / "latest").write_text(name + "\n")
                if self.hang_at and out.name.startswith(self.hang_at[0]) and step == self.hang_at[1]:
                    assert self.hang_marker is not None
                    with open(self.hang_marker, "a") as f:
                        f.write(f"{out.name} {os.getpid()}\n")
                    time.sleep(3600)
            if task is not None:
                progress.update(task, completed=step)
        wall = time.perf_counter() - t0
        # The final evaluation's sample is larger than the curve's: its loss differs a little from
        # the last evaluation's (FINAL_SAMPLE_SHIFT), so a test can tell which one the lab took.
        finished = step == tc.steps
        loss = fake_loss(cfg, step) + (FINAL_SAMPLE_SHIFT if finished else 0.0)
        return FakeResult(final_val_loss=loss, final_val_bpb=loss / math.log(2) / 3.5, val_curve=val,
                          train_curve=train, tokens=step * tc.tokens_per_step, steps=step,
                          tokens_per_s=done * tc.tokens_per_step / wall if wall > 0 and done else 0.0,
                          wall_s=wall, params=1000, final_val_tokens=tc.final_eval_tokens if finished else None,
                          final_val_se=0.001 if finished else None,
                          final_val_batches=fake_batches(cfg, loss) if finished else None)


def fake_costs(model: ModelConfig, context: int, batch: int = 1, dtype_bytes: int = 2) -> dict[str, Any]:
    """Cost columns with the right shape: a decode branch doubles training FLOPs per token."""
    d, n_layers, vocab = model.d_model, model.n_layers, model.vocab_size
    embed = vocab * d * (1 if model.tie_embeddings else 2)
    params = 12 * n_layers * d * d + embed
    rows = 2 if model.branch.enabled else 1
    kv = 2 * n_layers * d * dtype_bytes
    return {
        "params_total": params, "params_active": params, "params_embedding": embed,
        "train_flops_per_token": rows * (6 * params + 6 * n_layers * d * context),
        "prefill_flops_per_token": 2 * params + 2 * n_layers * d * context,
        "decode_flops_per_token": rows * (2 * params + 4 * n_layers * d * context),
        "kv_bytes_per_token": kv, "decode_bytes_per_step": params * dtype_bytes + batch * context * kv,
        "context": context, "batch": batch, "dtype_bytes": dtype_bytes,
    }


class FakePrepare:
    """Records prepare calls and creates the directory, as the real ``prepare`` does at its end."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *, source: str, out_dir: Path, vocab_size: int, max_bytes: int | None) -> dict[str, Any]:
        self.calls.append(dict(source=source, out_dir=Path(out_dir), vocab_size=vocab_size, max_bytes=max_bytes))
        Path(out_dir).mkdir(parents=True)
        return {}


SUITE_YAML = """\
name: fake
description: lab test suite
preset: tiny
base:
  data: {path: /nonexistent-data}
  train: {warmup_steps: 2, eval_every: 5, ckpt_every: 10, log_every: 5}
budget: {tokens: 81920, match: iso-token}   # 40 steps of 16 x 128
seeds: {baseline: [0, 1, 2], variants: [0, 1]}
baseline: llama
variants:
  lower-init: {model.init_std: 0.01}
  same: {model.rope_theta: 5000.0}
eval: {last_k: 1}
"""


def write_suite(dir_: Path, text: str = SUITE_YAML, name: str = "suite.yaml") -> Path:
    path = dir_ / name
    path.write_text(text)
    return path


def fake_accuracy(cfg: RunConfig, task: str) -> float:
    """A run's downstream accuracy: better with a lower init_std (like ``fake_loss``), plus noise."""
    rng = random.Random(f"{cfg.hash()}/{task}")
    return min(1.0, max(0.0, 0.5 - 5.0 * (cfg.model.init_std - 0.02) + rng.gauss(0.0, 0.005)))


class FakeEval:
    """Callable with ``archlab.lab.runner.evaluate_run``'s signature; records (run directory name,
    tasks) per call. A run without a checkpoint is a ``CheckpointError``, as with the real one.
    ``fail_on=k``: the k-th call raises ``KeyboardInterrupt`` (an evaluation killed half-way)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.fail_on = fail_on
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, run_dir: Path, cfg: RunConfig, tasks: dict[str, list[Any]], *,
                 progress: Any = None) -> dict[str, dict[str, Any]]:
        self.calls.append((Path(run_dir).name, sorted(tasks)))
        if self.fail_on == len(self.calls):
            raise KeyboardInterrupt
        if not (Path(run_dir) / "ckpt" / "latest").is_file():
            raise CheckpointError(f"{str(run_dir)!r} holds no checkpoint (no state.json or ckpt/latest)")
        out: dict[str, dict[str, Any]] = {}
        for name, items in tasks.items():
            n, acc = len(items), fake_accuracy(cfg, name)
            if progress is not None:
                progress(n)
            out[name] = {"acc": acc, "acc_stderr": math.sqrt(acc * (1 - acc) / n), "n": n}
            if name == "lambada":
                out[name]["ppl"] = 40.0
            else:
                out[name].update(acc_norm=acc + 0.01, acc_norm_stderr=math.sqrt(acc * (1 - acc) / n))
        return out


def write_tasks(dir_: Path) -> Path:
    """piqa (uniform JSONL, 14 items) and lambada (JSONL, 16 items) from the eval tests' sentence."""
    from tests.eval.conftest import lambada_items, mc_items, stdlib_sentence

    words = stdlib_sentence().split(" ")
    dir_.mkdir(parents=True, exist_ok=True)
    with open(dir_ / "piqa.jsonl", "w") as f:
        for it in mc_items(words):
            row = {"context": it.context, "continuations": list(it.continuations), "gold": it.gold}
            f.write(json.dumps(row) + "\n")
    with open(dir_ / "lambada.jsonl", "w") as f:
        for it in lambada_items(words):
            f.write(json.dumps({"context": it.context, "target": it.target}) + "\n")
    return dir_


DOWNSTREAM_EVAL = "eval: {last_k: 1, tasks: [piqa, lambada], task_dir: tasks, limit: 5}\n"


def fake_latency_ms(cfg: RunConfig, phase: str, batch: int, length: int) -> float:
    """A run's latency at a shape: longer shapes and bigger batches cost more; a lower init_std
    (the ``lower-init`` variant) costs 10% more, so its ratio to the baseline is known."""
    base = 0.01 * length if phase == "prefill" else 0.5 + 0.05 * batch + 0.001 * length
    return base * (1.1 if cfg.model.init_std < 0.02 else 1.0)


class FakeMeasure:
    """Callable with ``archlab.lab.latency.measure_run``'s signature; records (run directory name,
    shape keys, device) per call. A run without a checkpoint is a ``CheckpointError``, as with the
    real one. ``fail_on=k``: the k-th call raises ``KeyboardInterrupt`` (a pass killed half-way)."""

    def __init__(self, fail_on: int | None = None, device: str = "fake-gpu") -> None:
        self.fail_on, self.device = fail_on, device
        self.calls: list[tuple[str, list[tuple[str, int, int]], str]] = []

    def __call__(self, run_dir: Path, cfg: RunConfig, shapes: list[Any], *, device: str) -> Any:
        from archlab.lab.latency import Measured, Timing

        self.calls.append((Path(run_dir).name, [s.key for s in shapes], device))
        if self.fail_on == len(self.calls):
            raise KeyboardInterrupt
        if not (Path(run_dir) / "ckpt" / "latest").is_file():
            raise CheckpointError(f"{str(run_dir)!r} holds no checkpoint (no state.json or ckpt/latest)")
        timings = [Timing(s, fake_latency_ms(cfg, s.phase, s.batch, s.length),
                          mfu=0.5 if s.phase == "prefill" else None,
                          roofline_ms=None if s.phase == "prefill" else 0.1) for s in shapes]
        return Measured(device=self.device, dtype="bfloat16", timer="cuda-events", bandwidth=4e12, timings=timings)


# Short latency settings for the fake suite (measured on any device: ``always``).
MEASURE_COSTS = "costs: {measure: always, prompt: 32, context: 16, steps: 3, batches: [1, 8]}\n"


def stubborn_worker(db_path: Any, job: Any, train_fn: Any) -> None:
    """A pool worker that ignores SIGTERM (a run stuck in a long device call), for the stop tests."""
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(job).touch()  # ready: from now on only SIGKILL ends it
    time.sleep(60)
