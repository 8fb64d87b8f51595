"""The decode-attention kernel's launch shape, timed per decode shape on a GPU.

    python benchmarks/decode_attention_sweep.py --json sweep.json

``kernels/decode_attention.py`` splits each sequence's cache over programs (``MIN_SPLIT`` slots at
least per split), walks a split ``BLOCK_N`` slots at a time in a loop pipelined ``NUM_STAGES``
deep, and merges the splits either in the same launch (the last program of a head merges:
``counters``) or in a second kernel. This times every combination of those on the decode shapes of
the 124m and 1b presets (a cache of 2049 slots holding ``--context`` tokens; one row per sequence
for the baseline, two with the decode branch), each call on its own copy of the cache so that no
read comes from L2 (as in a decode step, whose weights evict the cache between layers), inside
one CUDA graph of ``--calls`` calls (median of 5 replays). It first checks every configuration
against the eager reference. Prints one table per shape, fastest first, and the configuration
that is best summed over the shapes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from archlab.kernels import decode_attention as da  # noqa: E402
from gemv_bandwidth import graph_ms  # noqa: E402

# name: (batch, query heads, key/value heads, head dim, rows per sequence)
SHAPES = {"124m b1": (1, 12, 12, 64, 1), "124m b1 branch": (1, 12, 12, 64, 2),
          "1b b1": (1, 32, 8, 64, 1), "1b b1 branch": (1, 32, 8, 64, 2),
          "1b b8": (8, 32, 8, 64, 1), "1b b8 branch": (8, 32, 8, 64, 2)}


def time_calls(fn, calls: int) -> float:
    """Microseconds per call of ``fn``, which makes ``calls`` calls: replayed in one CUDA graph
    (``gemv_bandwidth.graph_ms``); on CPU, for a smoke test, one uncaptured run on the wall
    clock."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6 / calls
    return graph_ms(fn, 1) * 1e3 / calls


def configure(min_split: int, block_n: int, stages: int | None, warps: int) -> None:
    da.MIN_SPLIT, da.BLOCK_N, da.NUM_STAGES, da.NUM_WARPS = min_split, block_n, stages, warps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--slots", type=int, default=2049)
    ap.add_argument("--calls", type=int, default=24, help="calls per graph, each on its own cache copy")
    ap.add_argument("--min-splits", default="64,128,256")
    ap.add_argument("--block-ns", default="32,64")
    ap.add_argument("--stages", default="0,1", help="pipelining depths; 0 is Triton's default")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs Triton's interpreter (TRITON_INTERPRET=1), "
                    "a smoke test of this script")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("decode_attention_sweep: no CUDA device; nothing to time")
        return
    dev = torch.device(args.device)

    def ints(flag: str, text: str, least: int) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < least:
            ap.error(f"{flag}: comma-separated integers of at least {least}, got {text!r}")
        return values

    shapes = args.shapes.split(",")
    if not set(shapes) <= set(SHAPES):
        ap.error(f"--shapes: each of {', '.join(SHAPES)}; got {args.shapes!r}")
    if not 0 < args.context <= args.slots or args.calls < 1:
        ap.error("--context must be in 1..--slots, and --calls at least 1")
    configs = [(ms, bn, st or None, w, True) for ms, bn, st, w in itertools.product(
        ints("--min-splits", args.min_splits, 1), ints("--block-ns", args.block_ns, 16),
        ints("--stages", args.stages, 0), ints("--warps", args.warps, 1))]
    configs.append((256, 64, None, 4, False))  # the kernel before fused merging: two launches
    defaults = (da.MIN_SPLIT, da.BLOCK_N, da.NUM_STAGES, da.NUM_WARPS)
    rows = []
    for name in shapes:
        b, hq, kvh, d, g = SHAPES[name]
        gen = torch.Generator(device=dev).manual_seed(0)
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        caches = [(torch.randn(b, kvh, args.slots, d, device=dev, generator=gen, dtype=dtype),
                   torch.randn(b, kvh, args.slots, d, device=dev, generator=gen, dtype=dtype))
                  for _ in range(args.calls)]
        q = torch.randn(b, hq, g, d, device=dev, generator=gen, dtype=dtype)
        last = torch.full((b, 1), args.context - 1, device=dev, dtype=torch.long)
        counters = da.split_counters(b * kvh, dev)
        want = da.decode_attention_reference(q, *caches[0], last).float()
        kv_mb = 2 * b * kvh * args.context * d * 2 / 1e6
        for ms, bn, st, w, fused in configs:
            configure(ms, bn, st, w)
            c = counters if fused else None
            got = da.decode_attention(q, *caches[0], last, counters=c).float()
            err = ((got - want).norm() / want.norm()).item()
            us = time_calls(lambda: [da.decode_attention(q, k, v, last, counters=c) for k, v in caches], args.calls)
            splits = da.default_splits(b, kvh, args.slots)
            r = {"shape": name, "min_split": ms, "block_n": bn, "stages": st or 0, "warps": w, "fused": fused,
                 "splits": splits, "us": us, "rel_err": err, "kv_MB": kv_mb,
                 "TBps": kv_mb / 1e6 / (us / 1e6)}
            rows.append(r)
            print(json.dumps(r), flush=True)
            if not err < 2e-2:
                print(f"  WRONG: relative error {err:.3g}", flush=True)
        configure(*defaults)
        del caches
    for name in shapes:
        print(f"\n{name} (context {args.context}):")
        print("| min split | block n | stages | warps | merge | us | KV read TB/s |")
        print("|---|---|---|---|---|---|---|")
        for r in sorted((r for r in rows if r["shape"] == name), key=lambda r: r["us"])[:6]:
            print(f"| {r['min_split']} | {r['block_n']} | {r['stages'] or 'default'} | {r['warps']} | "
                  f"{'fused' if r['fused'] else 'kernel'} | {r['us']:.2f} | {r['TBps']:.2f} |")
        base = next(r for r in rows if r["shape"] == name and not r["fused"])
        print(f"(before: two launches, min split 256, block 64: {base['us']:.2f} us)")
    total = {}
    for r in rows:
        key = (r["min_split"], r["block_n"], r["stages"], r["warps"], r["fused"])
        total[key] = total.get(key, 0.0) + r["us"]
    best = min(total, key=total.get)
    print(f"\nbest summed over the shapes: min_split={best[0]} block_n={best[1]} stages={best[2] or 'default'} "
          f"warps={best[3]} fused={best[4]}: {total[best]:.1f} us against "
          f"{total[(256, 64, 0, 4, False)]:.1f} us before")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    os._exit(0)


if __name__ == "__main__":
    main()
