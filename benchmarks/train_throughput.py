"""Training throughput: tokens/s, MFU and peak memory of the real trainer step, per preset/variant.

    PYTHONPATH=src python benchmarks/train_throughput.py --data DIR [--presets 124m,350m]
        [--variants baseline,decode-branch,attnres-triton] [--steps 20] [--warmup 8] [--no-compile]

Runs ``archlab.train.trainer.Run.train_step`` (the exact step `archlab train` runs: bf16 autocast,
fused AdamW, gradient clipping, the loader) on prepared data, times it with CUDA events after
warm-up (compilation included in warm-up, never in the numbers) and prints a markdown table.
MFU uses the PaLM convention (``mfu_flops_per_token``) against the detected device's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from archlab.config import make_config
from archlab.model.accounting import mfu_flops_per_token
from archlab.train.device import peak_flops
from archlab.train.trainer import Run

VARIANTS = {
    "baseline": [],
    "decode-branch": ["model.branch.enabled=true"],
    "attnres-reference": ["model.residual.kind=attnres", "model.residual.impl=reference"],
    "attnres-compile": ["model.residual.kind=attnres", "model.residual.impl=compile"],
    "attnres-triton": ["model.residual.kind=attnres", "model.residual.impl=triton"],
    "mhar4-triton": ["model.residual.kind=attnres", "model.residual.heads=4", "model.residual.impl=triton"],
    "block8-mhar4-triton": ["model.residual.kind=attnres", "model.residual.heads=4", "model.residual.blocks=8",
                            "model.residual.impl=triton"],
    "moe8x2": ["model.ffn=moe", "model.moe.n_experts=8", "model.moe.top_k=2"],
}


def measure(preset: str, variant: str, data: str, steps: int, warmup: int, compile_: bool,
            extra: list[str]) -> dict:
    overrides = [f"data.path={data}", "train.device=cuda", f"train.compile={str(compile_).lower()}",
                 *VARIANTS[variant], *extra]
    cfg = make_config(preset, overrides=overrides)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run = Run(cfg, out_dir="/tmp/unused")
    t_compile = time.perf_counter()
    for s in range(warmup):
        run.train_step(s)
    torch.cuda.synchronize()
    t_compile = time.perf_counter() - t_compile
    times = []
    for s in range(warmup, warmup + steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run.train_step(s)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    dt = statistics.median(times)
    tok_s = cfg.train.tokens_per_step / dt
    peak = peak_flops(run.device)
    flops = mfu_flops_per_token(cfg.model, cfg.train.seq_len)
    params = sum(p.numel() for p in run.model.parameters())
    res = {"preset": preset, "variant": variant, "params_M": params / 1e6, "tokens_per_step": cfg.train.tokens_per_step,
           "step_ms": dt * 1e3, "step_ms_spread": (max(times) - min(times)) * 1e3, "tok_s": tok_s,
           "mfu": tok_s * flops / peak if peak else None, "peak_GiB": torch.cuda.max_memory_allocated() / 2**30,
           "warmup_s": t_compile}
    del run
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="prepared data directory (vocab <= the presets' 50304)")
    ap.add_argument("--presets", default="124m,350m")
    ap.add_argument("--variants", default="baseline")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--set", action="append", default=[], dest="extra")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("train_throughput: no CUDA device; nothing to measure")
        return
    rows = []
    for preset in args.presets.split(","):
        for variant in args.variants.split(","):
            try:
                r = measure(preset, variant, args.data, args.steps, args.warmup, not args.no_compile, args.extra)
            except Exception as e:  # report and go on: one variant failing must not hide the rest
                r = {"preset": preset, "variant": variant, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, compile={not args.no_compile}\n")
    print("| preset | variant | params (M) | tokens/step | step (ms) | tokens/s | MFU | peak GiB | vs baseline |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = {r["preset"]: r["tok_s"] for r in rows if r.get("variant") == "baseline" and "tok_s" in r}
    for r in rows:
        if "error" in r:
            print(f"| {r['preset']} | {r['variant']} | error: {r['error'][:120]} |||||||")
            continue
        ratio = f"{r['tok_s'] / base[r['preset']]:.3f}x" if r["preset"] in base else "-"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"| {r['preset']} | {r['variant']} | {r['params_M']:.1f} | {r['tokens_per_step']} | {r['step_ms']:.1f} "
              f"| {r['tok_s']:,.0f} | {mfu} | {r['peak_GiB']:.1f} | {ratio} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # skip slow interpreter teardown of compiled graphs


if __name__ == "__main__":
    main()
