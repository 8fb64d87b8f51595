"""Training throughput: tokens/s, MFU and peak memory of the real trainer step, per preset/variant.

    PYTHONPATH=src python benchmarks/train_throughput.py --data DIR [--presets 124m,350m]
        [--variants baseline,decode-branch,attnres-triton] [--steps 20] [--warmup 8] [--no-compile]
        [--profile VARIANT] [--json FILE]

A variant name ending in ``/mb4`` runs with a quarter of the micro-batch and four times the
gradient accumulation (same tokens per step), for variants whose activations do not fit
otherwise (the eager reference routing). ``/graph`` replays the step as one CUDA graph
(``train.cuda_graph``); suffixes combine (``attnres-triton/graph/mb4``). Warm-up must cover the
graph's three ordinary steps and its capture, so use ``--warmup`` of at least 5 with ``/graph``.
``/fused`` computes the loss without keeping the logits (``train.fused_readout``:
``kernels/linear_cross_entropy.py``); rows kinds with their own readout ignore it. ``/cd`` turns on
inductor's coordinate-descent tuning of the kernels it generates (as gpt-fast does), and
``/autotune`` compiles with ``mode="max-autotune-no-cudagraphs"`` (inductor times Triton matmul
templates, with fused epilogues, against cuBLAS per shape): both only while that variant is
built and warmed up.

``zoo-NAME`` runs the shipped ``configs/zoo/NAME.yaml`` over the preset (``zoo-prism``,
``zoo-triplu``, ``zoo-variable_width``, ``zoo-gamma_init``, ``zoo-layerrope``, ...).

``--profile VARIANT`` also profiles three steps of that variant with torch.profiler and prints
where the GPU time goes by kernel category and how much of the step the GPU is busy at all (the
rest is host and launch time).

Runs ``archlab.train.trainer.Run.train_step`` (the exact step `archlab train` runs: bf16 autocast,
fused AdamW, gradient clipping, the loader) on prepared data, times it with CUDA events after
warm-up (compilation included in warm-up, never in the numbers) and prints a markdown table.
MFU uses the PaLM convention (``mfu_flops_per_token``) against the detected device's peak.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time

import torch

from archlab.config import make_config
from archlab.model.accounting import mfu_flops_per_token
from archlab.io.device import peak_flops
from archlab.train.trainer import Run

VARIANTS = {
    "baseline": [],
    "decode-branch": ["model.branch.enabled=true"],
    "attnres-reference": ["model.residual.kind=attnres", "model.residual.impl=reference"],
    # the reference routing in an uncompiled model: the "eager" row
    "attnres-eager": ["model.residual.kind=attnres", "model.residual.impl=reference", "train.compile=false"],
    "attnres-compile": ["model.residual.kind=attnres", "model.residual.impl=compile"],
    "attnres-triton": ["model.residual.kind=attnres", "model.residual.impl=triton"],
    "mhar4-triton": ["model.residual.kind=attnres", "model.residual.heads=4", "model.residual.impl=triton"],
    "mhar8-triton": ["model.residual.kind=attnres", "model.residual.heads=8", "model.residual.impl=triton"],
    "block8-attnres-triton": ["model.residual.kind=attnres", "model.residual.blocks=8", "model.residual.impl=triton"],
    "block8-mhar4-triton": ["model.residual.kind=attnres", "model.residual.heads=4", "model.residual.blocks=8",
                            "model.residual.impl=triton"],
    # a converted model's continued pretraining: standard stream + gated MHAR over per-layer deltas
    "delta-mhar4-triton": ["model.residual.kind=delta", "model.residual.heads=4", "model.residual.impl=triton"],
    "moe8x2": ["model.ffn=moe", "model.moe.n_experts=8", "model.moe.top_k=2"],
}
# The routing's dtype options (defaults: bf16 sources under autocast, gradient sums in bf16 too).
for _name in ("attnres-triton", "mhar4-triton"):
    VARIANTS[f"{_name}-fp32src"] = [*VARIANTS[_name], "model.residual.source_dtype=float32"]
    VARIANTS[f"{_name}-bf16grad"] = [*VARIANTS[_name], "model.residual.grad_dtype=bfloat16"]

# The deferred backward (each source's gradient assembled once from its readers' kept terms).
for _name in ("attnres-triton", "mhar4-triton", "mhar8-triton", "block8-attnres-triton", "block8-mhar4-triton",
              "delta-mhar4-triton"):
    VARIANTS[f"{_name}-deferred"] = [*VARIANTS[_name], "model.residual.backward=deferred"]

# The zoo options exactly as users run them: each ``configs/zoo/NAME.yaml`` is a variant
# ``zoo/NAME`` (its YAML is layered over the preset, so the benchmark cannot drift from the file).
ZOO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "zoo")
ZOO = {f"zoo-{f[:-5]}": os.path.join(ZOO_DIR, f) for f in sorted(os.listdir(ZOO_DIR)) if f.endswith(".yaml")}


# Kernel-name fragments -> category, first match wins (names as the CUDA profiler reports them).
CATEGORIES = [
    ("routing fwd", ("_route_fwd",)),
    ("routing bwd", ("_route_bwd", "_reduce_partials", "_assemble_grad")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_", "matmul", "splitk")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("fused elementwise (inductor)", ("triton_",)),
    ("copies", ("copy", "memcpy", "memset", "fill", "cat")),
    ("elementwise (eager)", ("elementwise", "vectorized", "reduce", "add", "mul")),
]


def categorise(name: str) -> str:
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


def profile_steps(run: Run, first_step: int, steps: int = 3, top_n: int = 15) -> dict:
    """GPU time per kernel category over ``steps`` steps, and the GPU-busy share of the wall time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for s in range(first_step, first_step + steps):
            run.train_step(s)
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    by_cat: dict[str, float] = {}
    top: list[tuple[float, str]] = []
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = evt.self_device_time_total
        if us <= 0:
            continue
        by_cat[categorise(evt.key)] = by_cat.get(categorise(evt.key), 0.0) + us / 1e3 / steps
        top.append((us / 1e3 / steps, evt.key[:120]))
    busy = sum(by_cat.values())
    return {"wall_ms_per_step_profiled": wall_ms, "gpu_busy_ms_per_step": busy,
            "by_category_ms": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": sorted(top, reverse=True)[:top_n]}


def measure(preset: str, variant: str, data: str, steps: int, warmup: int, compile_: bool,
            extra: list[str], profile: bool = False, top_n: int = 15) -> dict:
    name, *mods = variant.split("/")
    if unknown := set(mods) - {"mb4", "graph", "fused", "cd", "autotune"}:
        raise ValueError(f"unknown variant suffix {sorted(unknown)}; known: /mb4, /graph, /fused, /cd, /autotune")
    micro4 = "mb4" in mods
    overrides = [f"data.path={data}", "train.device=cuda", f"train.compile={str(compile_).lower()}",
                 *VARIANTS.get(name, []), *(["train.cuda_graph=true"] if "graph" in mods else []),
                 *(["train.fused_readout=true"] if "fused" in mods else []), *extra]
    cfg = make_config(preset, files=[ZOO[name]] if name in ZOO else [], overrides=overrides)
    if micro4:
        if cfg.train.batch_size % 4:
            raise ValueError(f"/mb4 needs a batch size divisible by 4, got {cfg.train.batch_size}")
        cfg.train.batch_size //= 4
        cfg.train.grad_accum *= 4
    gc.collect()  # the previous variant's run (and any CUDA graph pool it held) goes first
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    import torch._inductor.config as inductor_config

    compile_fn, tuning = torch.compile, inductor_config.coordinate_descent_tuning
    if "autotune" in mods:
        torch.compile = functools.partial(compile_fn, mode="max-autotune-no-cudagraphs")
    inductor_config.coordinate_descent_tuning = tuning or "cd" in mods
    try:
        run = Run(cfg, out_dir="/tmp/unused")
        t_compile = time.perf_counter()
        for s in range(warmup):
            run.train_step(s)
        torch.cuda.synchronize()
        t_compile = time.perf_counter() - t_compile
    finally:
        torch.compile, inductor_config.coordinate_descent_tuning = compile_fn, tuning
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
    if profile:
        res["profile"] = profile_steps(run, warmup + steps, top_n=top_n)
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
    ap.add_argument("--profile", action="append", default=[], metavar="VARIANT",
                    help="also profile this variant's step (repeatable)")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per profile (default 15)")
    args = ap.parse_args()
    if args.top < 1:
        ap.error(f"--top must be at least 1, got {args.top}")
    if not torch.cuda.is_available():
        print("train_throughput: no CUDA device; nothing to measure")
        return
    known = {**VARIANTS, **ZOO}
    for variant in args.variants.split(","):
        if variant.split("/")[0] not in known:
            ap.error(f"unknown variant {variant!r}; known: {', '.join(known)}")
    rows = []
    for preset in args.presets.split(","):
        for variant in args.variants.split(","):
            try:
                r = measure(preset, variant, args.data, args.steps, args.warmup, not args.no_compile, args.extra,
                            profile=variant in args.profile, top_n=args.top)
            except Exception as e:  # report and go on: one variant failing must not hide the rest
                r = {"preset": preset, "variant": variant, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, compile={not args.no_compile}\n")
    print("| preset | variant | params (M) | tokens/step | step (ms) | tokens/s | MFU | peak GiB | vs baseline |")
    print("|---|---|---|---|---|---|---|---|---|")
    # Each row against the baseline of its preset run the same way (graphed against graphed), else
    # against the plain one.
    def graphed(r: dict) -> bool:
        return "graph" in r["variant"].split("/")[1:]

    def plain_baseline(r: dict) -> bool:  # the baseline with no suffix but /graph
        name, *mods = r["variant"].split("/")
        return name == "baseline" and set(mods) <= {"graph"} and "tok_s" in r

    base = {(r["preset"], graphed(r)): r["tok_s"] for r in rows if plain_baseline(r)}
    for r in rows:
        if "error" in r:
            print(f"| {r['preset']} | {r['variant']} | error: {r['error'][:120]} |||||||")
            continue
        ref = base.get((r["preset"], graphed(r)), base.get((r["preset"], not graphed(r))))
        ratio = f"{r['tok_s'] / ref:.3f}x" if ref else "-"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"| {r['preset']} | {r['variant']} | {r['params_M']:.1f} | {r['tokens_per_step']} | {r['step_ms']:.1f} "
              f"| {r['tok_s']:,.0f} | {mfu} | {r['peak_GiB']:.1f} | {ratio} |")
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            print(f"\nprofile {r['preset']} {r['variant']}: step {p['wall_ms_per_step_profiled']:.1f} ms wall "
                  f"(under the profiler), GPU busy {p['gpu_busy_ms_per_step']:.1f} ms")
            print("| kernel category | GPU ms/step |\n|---|---|")
            for cat, ms in p["by_category_ms"].items():
                print(f"| {cat} | {ms:.2f} |")
            print("top kernels (ms/step):")
            for ms, key in p["top_kernels_ms"]:
                print(f"  {ms:7.2f}  {key}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # skip slow interpreter teardown of compiled graphs


if __name__ == "__main__":
    main()
