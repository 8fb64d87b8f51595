"""Distributed training throughput: tokens/s and peak memory per GPU, 1 GPU against N under torchrun.

    PYTHONPATH=src python benchmarks/distributed_scaling.py [--presets 124m,350m] [--nproc 2]
        [--layouts ddp,fsdp] [--steps 30] [--warmup 5] [--data DIR] [--json FILE] [--budget-s 540]

For each preset it measures the real trainer step (``archlab.train.trainer.Run.train_step``:
bf16 autocast, fused AdamW, clipping, the loader; under torchrun the DDP or FSDP wrapping of
``archlab.train.distributed``) in a fresh process: once on one GPU, then with ``torchrun
--standalone --nproc-per-node N`` for each layout, which this script launches itself. Each
measurement runs ``--warmup`` untimed steps (compilation happens there) and then ``--steps``
timed ones; tokens/s counts the global batch.

Scaling is weak by default (``--scaling weak``): every GPU keeps the preset's batch, so N GPUs
run a global batch N times larger and ideal scaling is N times the tokens/s. ``--scaling strong``
keeps the preset's global batch and splits it. Peak memory is ``torch.cuda.max_memory_allocated``,
the largest over the ranks. Compilation (``train.compile``, on in the GPU presets) is of the whole
model on one GPU and per block under torchrun, as ``archlab train`` does.

``--budget-s`` skips the measurements that would start after that many seconds (the table says
which), so the script fits one time-limited call. Without ``--data`` it prepares a small corpus
(the interpreter's stdlib, 512-token vocabulary) once into ``--data-cache``; throughput does not
depend on the text.

CPU smoke check (gloo, no GPU): ``--device cpu --presets tiny --steps 3 --warmup 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SRC = HERE.parents[1] / "src"


# ---- one measurement (in its own process, under torchrun or not) ---------------------------------
def worker(args) -> None:
    import torch

    from archlab.config import make_config
    from archlab.train import distributed
    from archlab.train.trainer import Run

    overrides = [f"data.path={args.data}", f"train.device={args.device}", f"train.parallel={args.layout}",
                 f"train.batch_size={args.batch_size}", *args.set]
    if args.device == "cpu":
        overrides.append("train.compile=false")
    cfg = make_config(args.preset, overrides=overrides)
    env = distributed.setup(cfg.train)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run = Run(cfg, Path(tmp), env)  # writes nothing: no checkpoint, no log
            cuda = run.device.type == "cuda"
            for step in range(args.warmup):
                float(run.train_step(step))
            if cuda:
                torch.cuda.synchronize(run.device)
                torch.cuda.reset_peak_memory_stats(run.device)
            if env is not None:
                env.barrier()
            t0 = time.perf_counter()
            loss = None
            for step in range(args.warmup, args.warmup + args.steps):
                loss = run.train_step(step)
            last = float(loss)  # waits for the device
            if cuda:
                torch.cuda.synchronize(run.device)
            elapsed = time.perf_counter() - t0
            if cuda:
                peak = torch.cuda.max_memory_allocated(run.device)
            else:  # CPU: the process's peak resident memory (kilobytes on Linux)
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            if env is not None:  # the largest over the ranks, and the slowest rank's time
                t = torch.tensor([float(peak), elapsed], dtype=torch.float64, device=run.device)
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
                peak, elapsed = int(t[0].item()), float(t[1].item())
            if env is None or env.is_main:
                tokens = args.steps * cfg.train.tokens_per_step
                Path(args.result).write_text(json.dumps({
                    "tokens_per_s": tokens / elapsed, "step_s": elapsed / args.steps, "peak_bytes": peak,
                    "global_batch": cfg.train.batch_size, "grad_accum": cfg.train.grad_accum,
                    "seq_len": cfg.train.seq_len, "final_loss": last}))
    finally:
        distributed.teardown(env)


# ---- the driver ---------------------------------------------------------------------------------
def _prepare_data(cache: Path) -> Path:
    if not (cache / "manifest.json").is_file():
        sys.path.insert(0, str(SRC))
        from archlab.data.prepare import prepare

        print(f"preparing a small corpus into {cache} (once)", flush=True)
        prepare("stdlib", cache, vocab_size=512, max_bytes=2_000_000)
    return cache


def _launch(args, preset: str, layout: str, nproc: int, batch: int, result: Path) -> dict | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    flags = ["--worker", "--preset", preset, "--layout", layout, "--batch-size", str(batch), "--data", str(args.data),
             "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--result", str(result), *[a for s in args.set for a in ("--set", s)]]
    if nproc == 1:
        cmd = [sys.executable, str(HERE), *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(HERE), *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not result.is_file():
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        print(f"  {preset} {layout} x{nproc} failed (exit {proc.returncode}):\n{tail}", file=sys.stderr, flush=True)
        return None
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="124m,350m", help="comma-separated presets (tiny, 20m, 124m, 350m, 1b)")
    ap.add_argument("--nproc", type=int, default=0, help="processes for the multi-GPU runs (default: every GPU; 2 on CPU)")
    ap.add_argument("--layouts", default="ddp,fsdp", help="comma-separated train.parallel layouts to measure")
    ap.add_argument("--scaling", choices=["weak", "strong"], default="weak",
                    help="weak: the preset's batch per GPU (default); strong: the preset's batch split over the GPUs")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--data", help="prepared data directory (default: prepare a small one into --data-cache)")
    ap.add_argument("--data-cache", default=os.path.join(tempfile.gettempdir(), "archlab-bench-stdlib"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    ap.add_argument("--json", help="write the results as JSON to this file")
    ap.add_argument("--budget-s", type=float, default=0, help="skip measurements starting after this many seconds")
    # the worker's own flags (set by the driver)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--preset", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    t_start = time.perf_counter()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --presets tiny for a smoke check")
        return
    nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    args.data = Path(args.data) if args.data else _prepare_data(Path(args.data_cache))
    sys.path.insert(0, str(SRC))
    from archlab.config import PRESETS

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            base_batch = PRESETS[preset]["train"]["batch_size"]
            plan = [("none", 1, base_batch)]
            plan += [(layout, nproc, base_batch * nproc if args.scaling == "weak" else base_batch)
                     for layout in args.layouts.split(",")]
            single = None
            for layout, n, batch in plan:
                label = "1 process" if n == 1 else f"{layout} x{n}"
                if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                    rows.append({"preset": preset, "layout": label, "skipped": "time budget"})
                    print(f"{preset} {label}: skipped (time budget)", flush=True)
                    continue
                if args.scaling == "strong" and batch % n:
                    rows.append({"preset": preset, "layout": label, "skipped": f"batch {batch} does not split over {n}"})
                    continue
                res = _launch(args, preset, layout, n, batch, Path(tmp) / f"{preset}-{layout}-{n}.json")
                row = {"preset": preset, "layout": label, "nproc": n, **(res or {"failed": True})}
                if res and n == 1:
                    single = res
                if res and single:
                    row["speedup"] = res["tokens_per_s"] / single["tokens_per_s"]
                    row["efficiency"] = row["speedup"] / n  # of the ideal n-fold tokens/s
                rows.append(row)
                if res:
                    print(f"{preset} {label}: {res['tokens_per_s']:,.0f} tok/s, peak {res['peak_bytes'] / 2**30:.2f} GiB"
                          f" per {'GPU' if args.device == 'cuda' else 'process'}", flush=True)

    unit = "GPU" if args.device == "cuda" else "process (RSS)"
    print(f"\n| preset | layout | global batch x accum x seq | tokens/s | speedup | efficiency | peak GiB per {unit} |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"| {r['preset']} | {r['layout']} | - | {r.get('skipped', 'failed')} | | | |")
            continue
        shape = f"{r['global_batch']} x {r['grad_accum']} x {r['seq_len']}"
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        eff = f"{r['efficiency']:.0%}" if "efficiency" in r else "-"
        print(f"| {r['preset']} | {r['layout']} | {shape} | {r['tokens_per_s']:,.0f} | {sp} | {eff} | "
              f"{r['peak_bytes'] / 2**30:.2f} |")
    print(f"\nscaling: {args.scaling}; {args.steps} timed steps after {args.warmup} warm-up steps; "
          f"device {torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"scaling": args.scaling, "steps": args.steps, "warmup": args.warmup,
                                               "device": args.device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
