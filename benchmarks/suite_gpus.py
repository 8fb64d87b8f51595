"""A suite on one GPU, then on two: the wall time of ``archlab compare --gpus``.

    PYTHONPATH=src python benchmarks/suite_gpus.py [--one 0] [--two 0,1] [--steps 600]
        [--seeds 2] [--runs-per-gpu 1] [--preset tiny] [--work DIR]
    PYTHONPATH=src python benchmarks/suite_gpus.py --device cpu --steps 20 --seeds 1   # logic check

Writes a small suite (the llama baseline, decode-branch and AttnRes, ``--seeds`` seeds each,
``--steps`` steps of the preset's batch, on the embedded standard-library corpus, prepared once
before anything is timed), runs ``archlab compare SUITE --gpus ONE`` into one results directory
and ``--gpus TWO`` into another, each timed end to end (worker start-up, training, the report),
and prints both wall times, their ratio, and the largest difference between the final
validation losses of the same run in the two directories (placement must not change results:
on CUDA it is bf16 nondeterminism only, on CPU zero). The defaults (6 runs of 600 tiny steps)
should take about 3 minutes in all on two H200s (an estimate: worker start-up of about 10 s
and a few ms per step; not yet measured); --steps and --seeds scale it.

``--device cpu`` trains on the CPU and takes the GPU indices as labels only (the placement, the
pinned worker processes and the claims are what it checks; the times say nothing about GPUs).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import yaml

from archlab.cli import build_parser
from archlab.config import make_config
from archlab.lab.cli import run_compare
from archlab.lab.store import DB_NAME, ResultStore

VARIANTS = {"decode-branch": {"model.branch.enabled": True}, "attnres": {"model.residual.kind": "attnres"}}


def suite_yaml(preset: str, steps: int, seeds: int, device: str, data: Path) -> str:
    train = make_config(preset).train
    tokens = steps * train.batch_size * train.seq_len
    every = max(1, steps // 4)
    suite = {
        "name": "suite-gpus",
        "description": f"benchmarks/suite_gpus.py: {1 + len(VARIANTS)} labels x {seeds} seeds, {steps} steps",
        "preset": preset,
        "base": {"data": {"path": str(data)},
                 "train": {"device": device, "eval_every": every, "ckpt_every": every,
                           "warmup_steps": max(1, steps // 10), "log_every": max(1, steps // 20)}},
        "budget": {"tokens": tokens, "match": "iso-token"},
        "seeds": {"baseline": list(range(seeds)), "variants": list(range(seeds)), "data": 0},
        "baseline": "llama",
        "variants": VARIANTS,
        "eval": {"batches": 4, "last_k": 2},
        "costs": {"measure": "never"},  # latency runs after training, in one process: not placement
    }
    return yaml.safe_dump(suite, sort_keys=False)


def compare(suite_file: Path, out: Path, gpus: str, runs_per_gpu: int, gpu_count: int | None) -> float:
    args = build_parser().parse_args(["compare", str(suite_file), "--out", str(out), "--gpus", gpus,
                                      "--runs-per-gpu", str(runs_per_gpu)])
    t0 = time.perf_counter()
    run_compare(args, gpu_count=gpu_count)
    return time.perf_counter() - t0


def final_losses(out: Path) -> dict[str, float | None]:
    with ResultStore(out / DB_NAME, create=False) as store:
        return {r.run_id: r.final_val_loss for r in store.runs() if r.status == "finished"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", default="0", help="--gpus of the first compare (default 0)")
    p.add_argument("--two", default="0,1", help="--gpus of the second compare (default 0,1)")
    p.add_argument("--runs-per-gpu", type=int, default=1, help="--runs-per-gpu of both compares (default 1)")
    p.add_argument("--preset", default="tiny", help="model and batch preset (default tiny)")
    p.add_argument("--steps", type=int, default=600, help="training steps per run (default 600)")
    p.add_argument("--seeds", type=int, default=2, help="seeds per label; runs = 3 x seeds (default 2)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a logic check, the GPU indices are labels only (default cuda)")
    p.add_argument("--work", type=Path, help="folder for the data and both suite directories "
                                             "(default: a new temporary folder, kept)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.seeds < 1 or a.runs_per_gpu < 1:
        p.error("--steps, --seeds and --runs-per-gpu must be at least 1")
    gpu_count = None  # ask torch
    if a.device == "cpu":
        gpu_count = 1 + max(int(g) for spec in (a.one, a.two) for g in spec.split(",") if g.strip().isdigit())
    else:
        import torch

        if not torch.cuda.is_available():
            print("suite_gpus: skipped: no CUDA device (use --device cpu for a logic check)")
            return 0
    work = a.work or Path(tempfile.mkdtemp(prefix="suite-gpus-"))
    work.mkdir(parents=True, exist_ok=True)
    for name in ("one", "two"):
        if (work / name / DB_NAME).exists():
            p.error(f"{work / name} already holds results; choose another --work")

    cfg = make_config(a.preset)
    data = work / "data" / f"stdlib-v{cfg.model.vocab_size}"
    if not data.exists():
        from archlab.data.prepare import prepare

        t0 = time.perf_counter()
        prepare("stdlib", data, vocab_size=cfg.model.vocab_size, max_bytes=2_000_000)
        print(f"prepared {data} in {time.perf_counter() - t0:.1f} s (not timed)")
    suite_file = work / "suite.yaml"
    suite_file.write_text(suite_yaml(a.preset, a.steps, a.seeds, a.device, data))

    t_one = compare(suite_file, work / "one", a.one, a.runs_per_gpu, gpu_count)
    t_two = compare(suite_file, work / "two", a.two, a.runs_per_gpu, gpu_count)
    one, two = final_losses(work / "one"), final_losses(work / "two")
    runs = 3 * a.seeds
    if len(one) != runs or set(one) != set(two):
        print(f"suite_gpus: FAILED: finished runs differ: {len(one)} and {len(two)} of {runs}")
        return 1
    diff = max(abs((one[k] or 0.0) - (two[k] or 0.0)) for k in one)
    print()
    print(f"| suite ({runs} runs, {a.steps} steps, {a.preset}, {a.device}) | --gpus | runs per GPU | wall s |")
    print("|---|---|---|---|")
    print(f"| one | {a.one} | {a.runs_per_gpu} | {t_one:.1f} |")
    print(f"| two | {a.two} | {a.runs_per_gpu} | {t_two:.1f} |")
    print(f"\nwall-time ratio one/two: {t_one / t_two:.2f}x; largest final val loss difference of the same "
          f"run: {diff:.2e}; results in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
