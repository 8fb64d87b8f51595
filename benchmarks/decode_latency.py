"""Decode-Branch against the baseline on the inference engine: decode ms/step and prefill (time to
first token), with the bandwidth roofline, per preset, measured in one process.

    python benchmarks/decode_latency.py --presets 124m,1b --batches 1,8 --context 1024 --prompt 2048 \
        --attention triton,sdpa

Both models of a preset share every weight but the branch's own tensors (the branch's coupling
vectors are random, as trained ones are non-zero). Each row runs through ``archlab.infer.bench``
(the engine that ``archlab serve`` and ``archlab bench`` use): a compiled prefill per length bucket
and a decode step captured as a CUDA graph. The roofline of a decode step is
``accounting.decode_bytes_per_step / measured copy bandwidth``; prefill is reported as MFU against
the detected device's peak. Prints a Markdown table and one JSON object per row.

``--attention triton,sdpa,sdpa-heads`` measures decode once per attention kernel of the decode
step, one table row each: ``triton`` is archlab's decode kernel (``kernels/decode_attention.py``,
the default on CUDA; ``triton-nosplit`` the same with one program per sequence and KV head, no
flash-decoding split), ``sdpa`` PyTorch's SDPA under the cache mask with the branch's rows as more
queries of their sequence, ``sdpa-heads`` the same with them as more query heads
(``layers.DECODE_ATTENTION`` and ``layers.GROUPED_DECODE``). The ratio of a row is within its
kernel: branch on that kernel against the baseline on that kernel.

``--linear cublas,triton`` measures decode once per kernel of the step's matmuls: cuBLAS, or
archlab's skinny-matmul kernel (``kernels/skinny_matmul.py``, ``layers.DECODE_LINEAR``).

``--rope torch,triton`` measures decode once per way of rotating q/k and writing the cache: torch
(inductor's kernels) or archlab's one fused kernel (``kernels/rope_cache.py``, ``layers.DECODE_ROPE``).

``--swiglu unfused,fused`` measures decode once per way of gating SwiGLU: inductor's
``silu(gate) * up`` kernel before ``w_down``, or the gating inside ``w_down``'s skinny-matmul kernel
(``layers.DECODE_SWIGLU``; only where ``--linear`` puts ``w_down`` on that kernel).
``--auto-max-out 1024,2048`` moves the rule of ``--linear auto`` (``layers.AUTO_MAX_OUT``: the widest
output it puts on the skinny kernel), so that 1b's 2048-wide ``wo`` and ``w_down`` can be tried there.

``--profile`` also profiles 20 batch-1 decode steps of each model on the first ``--attention``
kernel (the step body the graph captures, run uncaptured so the profiler sees every kernel) and
prints, per model, the kernels per step, the GPU-busy time per step and the kernels that take it,
so the branch's extra cost can be attributed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from archlab.infer.bench import (as_dict, baseline_and_branch, bench_decode, bench_prefill,  # noqa: E402
                                 copy_bandwidth, prompt_tokens)
from archlab.infer.engine import Engine  # noqa: E402
from archlab.infer.sampling import SamplingParams  # noqa: E402
from archlab.kernels import decode_attention  # noqa: E402
from archlab.model.core import layers  # noqa: E402


# --attention NAME: (layers.DECODE_ATTENTION, layers.GROUPED_DECODE, the kernel's smallest split)
ATTENTION = {"triton": ("triton", "time", decode_attention.MIN_SPLIT),
             "triton-nosplit": ("triton", "time", 1 << 30),
             "sdpa": ("sdpa", "time", None), "sdpa-heads": ("sdpa", "heads", None)}


def use(mode: str) -> None:
    layers.DECODE_ATTENTION, layers.GROUPED_DECODE, min_split = ATTENTION[mode]
    if min_split:
        decode_attention.MIN_SPLIT = min_split


def models(preset: str, max_len: int, extra: list[str]):
    """(baseline, decode-branch) in bf16 on CUDA, the baseline holding the branch model's weights."""
    return baseline_and_branch(preset, max_len, extra, torch.device("cuda"), torch.bfloat16)


def profile_decode(model, context: int, steps: int = 20) -> dict:
    """GPU kernels of ``steps`` batch-1 decode steps: count, busy ms and the top kernels per step."""
    from torch.profiler import ProfilerActivity, profile

    eng = Engine(model, slots=1, max_len=context + 2 * steps + 16)
    eng.prefill([0], [prompt_tokens(context, model.cfg.vocab_size)], [SamplingParams(max_new_tokens=2 * steps)])
    for _ in range(3):  # compiled before profiling
        eng._step_body(True, False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng._step_body(True, False)
        torch.cuda.synchronize()
    return _kernel_table(prof, steps)


def profile_prefill(model, prompt: int, reps: int = 3) -> dict:
    """GPU kernels of one compiled prefill of a ``prompt``-token prompt (uncaptured)."""
    from torch.profiler import ProfilerActivity, profile

    eng = Engine(model, slots=1, max_len=max(prompt + 1, model.cfg.max_seq_len))
    tokens = prompt_tokens(prompt, model.cfg.vocab_size)
    eng.prefill([0], [tokens], [SamplingParams(max_new_tokens=1)])  # compiles and captures
    runner = next(iter(eng._prefills.values()))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            runner._body()
        torch.cuda.synchronize()
    return _kernel_table(prof, reps)


def _kernel_table(prof, calls: int) -> dict:
    kernels = [(e.self_device_time_total / 1e3 / calls, e.count / calls, e.key[:80])
               for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.self_device_time_total > 0]
    return {"kernels_per_step": sum(k[1] for k in kernels), "gpu_busy_ms": sum(k[0] for k in kernels),
            "top": sorted(kernels, reverse=True)[:14]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="124m,1b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--set", action="append", default=[], dest="extra", help="config override for both models")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--profile", action="store_true",
                    help="also profile batch-1 decode of both models on the first --attention kernel")
    ap.add_argument("--attention", default="triton",
                    help=f"decode attention kernels to measure, one or more of {tuple(ATTENTION)}")
    ap.add_argument("--linear", default=layers.DECODE_LINEAR,
                    help=f"decode-step matmul kernels to measure, one or more of {layers.DECODE_LINEAR_MODES}")
    ap.add_argument("--rope", default=layers.DECODE_ROPE,
                    help=f"decode RoPE + cache-write paths to measure, one or more of {layers.DECODE_ROPE_MODES}")
    ap.add_argument("--swiglu", default=layers.DECODE_SWIGLU,
                    help=f"decode SwiGLU gating, one or more of {layers.DECODE_SWIGLU_MODES} (fused: inside "
                         "w_down's skinny-matmul kernel, where --linear puts w_down on it)")
    ap.add_argument("--auto-max-out", default=str(layers.AUTO_MAX_OUT),
                    help="widest output --linear auto puts on the skinny-matmul kernel, one or more values "
                         f"(default {layers.AUTO_MAX_OUT}, the measured rule)")
    ap.add_argument("--compile-mode", help="torch.compile mode of the decode step",
                    choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    ap.add_argument("--coordinate-descent", action="store_true",
                    help="inductor's coordinate-descent tuning of its generated kernels (as gpt-fast sets)")
    ap.add_argument("--no-prefill", action="store_true", help="decode rows only")
    ap.add_argument("--no-branch", action="store_true",
                    help="decode the baseline only (a change that leaves the branch's step as it is)")
    ap.add_argument("--no-decode", action="store_true", help="prefill rows only")
    ap.add_argument("--profile-prefill", action="store_true", help="also profile one prefill of each model")
    args = ap.parse_args()
    if args.coordinate_descent:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True
    modes = args.attention.split(",")
    if not set(modes) <= set(ATTENTION):
        ap.error(f"--attention: each of {tuple(ATTENTION)}, got {args.attention!r}")
    linears = args.linear.split(",")
    if not set(linears) <= set(layers.DECODE_LINEAR_MODES):
        ap.error(f"--linear: each of {layers.DECODE_LINEAR_MODES}, got {args.linear!r}")
    ropes = args.rope.split(",")
    if not set(ropes) <= set(layers.DECODE_ROPE_MODES):
        ap.error(f"--rope: each of {layers.DECODE_ROPE_MODES}, got {args.rope!r}")
    swiglus = args.swiglu.split(",")
    if not set(swiglus) <= set(layers.DECODE_SWIGLU_MODES):
        ap.error(f"--swiglu: each of {layers.DECODE_SWIGLU_MODES}, got {args.swiglu!r}")
    try:
        widths = [int(w) for w in args.auto_max_out.split(",")]
    except ValueError:
        ap.error(f"--auto-max-out: comma-separated whole numbers, got {args.auto_max_out!r}")
    if min(widths) < 1:
        ap.error(f"--auto-max-out: each at least 1, got {args.auto_max_out!r}")
    if not torch.cuda.is_available():
        print("decode_latency: no CUDA device; nothing to measure")
        return
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_TBps": bw / 1e12, "torch": torch.__version__,
                      "compile_mode": args.compile_mode, "coordinate_descent": args.coordinate_descent}),
          flush=True)
    rows = []
    with torch.no_grad():
        for preset in args.presets.split(","):
            max_len = max(args.prompt, args.context + args.steps + 16)
            base, branch = models(preset, max_len, args.extra)
            if not args.no_prefill:
                pre = {name: bench_prefill(m, args.prompt) for name, m in (("baseline", base), ("branch", branch))}
                r = {"kind": "prefill", "preset": preset, "prompt": args.prompt,
                     "baseline": as_dict(pre["baseline"]), "branch": as_dict(pre["branch"]),
                     "ratio": pre["branch"].ms / pre["baseline"].ms}
                rows.append(r)
                print(json.dumps(r), flush=True)
            if args.profile_prefill:
                for name, m in (("baseline", base), ("branch", branch)):
                    prof = profile_prefill(m, args.prompt)
                    print(f"\nprofile {preset} {name} prefill {args.prompt}: {prof['kernels_per_step']:.0f} kernels, "
                          f"GPU busy {prof['gpu_busy_ms']:.3f} ms")
                    for ms, count, key in prof["top"]:
                        print(f"  {ms:7.4f} ms  x{count:4.1f}  {key}")
            for b in ([] if args.no_decode else [int(x) for x in args.batches.split(",")]):
                refs = {}  # the baseline has no branch rows: SDPA's placement of them changes nothing
                for mode, lin, rope, sw, wide in [(m, li, ro, sw, wi) for ro in ropes for sw in swiglus
                                                  for wi in widths for li in linears for m in modes]:
                    use(mode)  # read when the step is traced (a new engine per call)
                    layers.DECODE_LINEAR, layers.DECODE_ROPE, layers.DECODE_SWIGLU = lin, rope, sw
                    layers.AUTO_MAX_OUT = wide
                    kernel = (*ATTENTION[mode][0::2], lin, rope, sw, wide)
                    if kernel not in refs:
                        refs[kernel] = bench_decode(base, b, args.context, args.steps, bw,
                                                    compile_mode=args.compile_mode)
                    ref = refs[kernel]
                    dec = None if args.no_branch else bench_decode(branch, b, args.context, args.steps, bw,
                                                                   compile_mode=args.compile_mode)
                    r = {"kind": "decode", "preset": preset, "batch": b, "context": args.context, "attention": mode,
                         "linear": lin, "auto_max_out": wide, "rope": rope, "swiglu": sw, "baseline": as_dict(ref),
                         "branch": as_dict(dec) if dec else None,
                         "ratio": dec.ms_per_step / ref.ms_per_step if dec else None}
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            if args.profile:
                mode = modes[0]  # each profile compiles its own step: the first kernel listed only
                runs = [(f"{name} ({mode})", m, mode) for name, m in (("baseline", base), ("branch", branch))]
                for name, m, mode in runs:
                    use(mode)
                    layers.DECODE_LINEAR, layers.DECODE_ROPE, layers.DECODE_SWIGLU = linears[0], ropes[0], swiglus[0]
                    layers.AUTO_MAX_OUT = widths[0]
                    prof = profile_decode(m, args.context)
                    print(f"\nprofile {preset} {name} decode b1: {prof['kernels_per_step']:.0f} kernels/step, "
                          f"GPU busy {prof['gpu_busy_ms']:.3f} ms/step")
                    for ms, count, key in prof["top"]:
                        print(f"  {ms:7.4f} ms  x{count:4.1f}  {key}")
            del base, branch
            torch.cuda.empty_cache()
    print("\n| preset | phase | shape | baseline ms | decode-branch ms | ratio | roofline (baseline / branch) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b, d = r["baseline"], r["branch"]
        if r["kind"] == "prefill":
            mfu = lambda x: f"{x['mfu']:.1%} MFU" if x["mfu"] else "-"  # noqa: E731
            print(f"| {r['preset']} | prefill (TTFT) | prompt {r['prompt']} | {b['ms']:.3f} | {d['ms']:.3f} | "
                  f"{r['ratio']:.3f} | {mfu(b)} / {mfu(d)} |")
        else:
            kernels = (f"{r['attention']}, {r['linear']} (auto to {r['auto_max_out']} wide), rope {r['rope']}, "
                       f"swiglu {r['swiglu']}")
            if d is None:
                print(f"| {r['preset']} | decode ({kernels}) | batch {r['batch']}, ctx {r['context']} | "
                      f"{b['ms_per_step']:.3f} | - | - | {b['frac_of_roofline']:.1%} of {b['roofline_ms']:.3f} ms |")
                continue
            print(f"| {r['preset']} | decode ({kernels}) | batch {r['batch']}, ctx {r['context']} | "
                  f"{b['ms_per_step']:.3f} | "
                  f"{d['ms_per_step']:.3f} | {r['ratio']:.3f} | {b['frac_of_roofline']:.1%} / "
                  f"{d['frac_of_roofline']:.1%} of {b['roofline_ms']:.3f} / {d['roofline_ms']:.3f} ms |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    os._exit(0)  # skip interpreter teardown of compiled graphs


if __name__ == "__main__":
    main()
