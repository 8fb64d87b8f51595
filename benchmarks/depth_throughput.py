"""Training throughput of the compute-along-depth options: tokens/s and peak memory of the real
trainer step against the baseline, with the training FLOPs the accounting expects of each.

    PYTHONPATH=src python benchmarks/depth_throughput.py --data DIR [--preset 124m] [--device cuda]
        [--variants baseline,looped-k2,discoloop-k2,layer-dropout-0.1,layer-dropout-0.2]
        [--steps 20] [--warmup 8] [--no-compile] [--set KEY=VALUE ...] [--json FILE]

Runs ``archlab.train.trainer.Run.train_step`` (the step ``archlab train`` runs: autocast, AdamW,
clipping, the loader) on prepared data after ``--warmup`` steps (compilation included there, never
in the numbers) and prints a markdown table. On CUDA the step is timed with CUDA events and peak
memory is ``torch.cuda.max_memory_allocated``; on CPU (``--device cpu --preset tiny``, to check that
it runs) with the wall clock, and no peak memory is reported.

Variants:

* ``looped-k2``: ``model.schedule=looped``, K = 2 (every layer twice).
* ``discoloop-k2``: the same loop with DiscoLoop's channel between the iterations (learned gate,
  tied embeddings); ``discoloop-k2-chunked`` computes the channel over chunks of 2048 tokens,
  recomputed in backward (less memory, one more channel forward).
* ``layer-dropout-R``: layer dropout at a *mean drop rate* ``R`` over the blocks, held for the
  measurement: the blocks' probabilities rise linearly from 0 (first) to ``p_max`` (last), so the
  mean over the blocks is ``p_max / 2``, and ``p_max = 2 R`` with ``decay: false``. (With the
  default linear decay to 0, a run's mean drop rate is ``p_max / 4``.) ``drop`` is the fraction of
  (row, block) pairs the timed steps actually dropped, against the rate asked for; ``FLOPs`` the
  accounting's training FLOPs per token against the baseline's, which tokens/s should follow
  inversely if dropped blocks cost nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from archlab.config import make_config
from archlab.model.accounting import train_flops_per_token
from archlab.model.variants.layer_dropout.schedule import mean_drop_rate
from archlab.train.trainer import Run

LOOP = ["model.schedule=looped", "model.looped.loops=2"]
DISCO = [*LOOP, "model.tie_embeddings=true", "model.looped.channel=disco", "model.looped.alpha_mode=learned"]
VARIANTS = {
    "baseline": [],
    "looped-k2": LOOP,
    "discoloop-k2": DISCO,
    "discoloop-k2-chunked": [*DISCO, "model.looped.chunk_tokens=2048"],
}


def variant_overrides(name: str) -> list[str]:
    """The config overrides of a variant (``layer-dropout-R`` for any rate R < 0.5)."""
    if name in VARIANTS:
        return VARIANTS[name]
    if name.startswith("layer-dropout-"):
        rate = float(name.removeprefix("layer-dropout-"))
        if not 0 < rate < 0.5:
            raise ValueError(f"{name}: the mean drop rate must be in (0, 0.5) (p_max = 2 x rate < 1)")
        return ["model.schedule=layer_dropout", f"model.layer_dropout.p_max={2 * rate}",
                "model.layer_dropout.decay=false"]
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}, layer-dropout-R")


def measure(preset: str, variant: str, data: str, device: str, steps: int, warmup: int, compile_: bool,
            extra: list[str]) -> dict:
    overrides = [f"data.path={data}", f"train.device={device}", f"train.compile={str(compile_).lower()}",
                 f"train.steps={warmup + steps}", *variant_overrides(variant), *extra]
    cfg = make_config(preset, overrides=overrides)
    cuda = device.startswith("cuda")
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    run = Run(cfg, out_dir="/tmp/unused")
    t0 = time.perf_counter()
    for s in range(warmup):
        float(run.train_step(s))
    warmup_s = time.perf_counter() - t0
    sched = run.model.schedule
    kept = []  # layer dropout: the fraction of rows each visit ran on, per timed step
    times = []
    for s in range(warmup, warmup + steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            loss = run.train_step(s)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            float(run.train_step(s))
            times.append(time.perf_counter() - t)
        if hasattr(sched, "kept_fraction"):
            kept.append(statistics.mean(sched.kept_fraction.values()))
    dt = statistics.median(times)
    res = {"preset": preset, "variant": variant, "step_ms": dt * 1e3,
           "tok_s": cfg.train.tokens_per_step / dt, "warmup_s": warmup_s,
           "peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "drop": 1 - statistics.mean(kept) if kept else 0.0,
           "drop_asked": (mean_drop_rate(cfg.model.layer_dropout.p_max, decay=False)
                          if cfg.model.schedule == "layer_dropout" else 0.0),
           "train_flops_per_token": train_flops_per_token(cfg.model, cfg.train.seq_len)}
    if cuda:
        del loss
    del run
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="prepared data directory (vocab <= the preset's)")
    ap.add_argument("--preset", default="124m", help="model and batch preset (tiny on CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", default="baseline,looped-k2,discoloop-k2,layer-dropout-0.1,layer-dropout-0.2")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps first (compilation)")
    ap.add_argument("--no-compile", action="store_true", help="eager model (default: compiled on CUDA)")
    ap.add_argument("--set", action="append", default=[], dest="extra", help="more config overrides")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        try:
            variant_overrides(v)
        except ValueError as e:
            ap.error(str(e))
    compile_ = args.device.startswith("cuda") and not args.no_compile
    rows = []
    for v in variants:
        try:
            r = measure(args.preset, v, args.data, args.device, args.steps, args.warmup, compile_, args.extra)
        except Exception as e:  # report and go on: one variant failing must not hide the rest
            r = {"preset": args.preset, "variant": v, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(r)
        print(json.dumps(r), flush=True)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"\n{where}, torch {torch.__version__}, preset {args.preset}, compile={compile_}\n")
    print("| variant | step (ms) | tokens/s | vs baseline | training FLOPs vs baseline | drop (asked) | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    base = next((r for r in rows if r["variant"] == "baseline" and "tok_s" in r), None)
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error'][:80]} | | | | | |")
            continue
        speed = f"{r['tok_s'] / base['tok_s']:.3f}x" if base else "-"
        flops = f"{r['train_flops_per_token'] / base['train_flops_per_token']:.3f}x" if base else "-"
        peak = f"{r['peak_GiB']:.2f}" if r["peak_GiB"] is not None else "-"
        drop = f"{r['drop']:.3f} ({r['drop_asked']:.2f})"
        print(f"| {r['variant']} | {r['step_ms']:.1f} | {r['tok_s']:,.0f} | {speed} | {flops} | {drop} | {peak} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
