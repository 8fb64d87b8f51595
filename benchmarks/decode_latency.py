"""Prefill and decode latency: decode-branch against the baseline, same weights, same shapes.

    PYTHONPATH=src python benchmarks/decode_latency.py --data DIR [--presets 124m,1b]
        [--batches 1,8,32] [--context 1024] [--prompts 512,2048]

Decode: one grouped step (primary row + branch row of the new token, one matmul per weight, one
attention call over the shared cache) compiled with ``mode="reduce-overhead"`` (CUDA graphs), the
KV cache in module buffers; median of per-step CUDA-event times after warm-up. Prefill: the
primary path over the prompt (eager), and for the branch the extra branch row at the last prompt
position. The roofline column is ``decode_bytes_per_step / measured copy bandwidth``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from archlab.config import make_config
from archlab.infer.generate import DecodeStep
from archlab.model import build_model
from archlab.model.accounting import decode_bytes_per_step

DEVICE = "cuda"


def copy_bandwidth() -> float:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / time_ms(lambda: y.copy_(x), 20) * 1e3


def time_ms(fn, iters: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    if DEVICE != "cuda":  # CPU smoke runs of this script
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def real_tokens(data: str, n: int, vocab: int) -> torch.Tensor:
    arr = np.fromfile(os.path.join(data, "val_000.bin"), dtype=np.uint16)
    reps = -(-n // len(arr))
    return torch.from_numpy(np.tile(arr, reps)[:n].astype(np.int64)).clamp_max(vocab - 1)


def models(preset: str, max_len: int):
    cfg = make_config(preset, overrides=[f"model.max_seq_len={max_len}", "model.branch.enabled=true"]).model
    torch.manual_seed(0)
    branch = build_model(cfg).to(DEVICE, torch.bfloat16).eval()
    for n, p in branch.named_parameters():  # trained couplings are non-zero; zeros would flatter nothing
        if ".couple_" in n:
            torch.nn.init.normal_(p, 0.0, 0.02)
    base_cfg = make_config(preset, overrides=[f"model.max_seq_len={max_len}"]).model
    base = build_model(base_cfg).to(DEVICE, torch.bfloat16).eval()
    base.load_state_dict({k: v for k, v in branch.state_dict().items() if k in base.state_dict()})
    return base, branch


def prefill_ms(model, toks: torch.Tensor, max_len: int) -> float:
    """Prefill of ``toks``, including the decode branch's first row when the model has one."""
    b, s = toks.shape
    dev = toks.device
    pos = torch.arange(s, device=dev)
    rope = pos[None].expand(b, s)
    valid = torch.ones(b, max_len, dtype=torch.bool, device=dev)
    cache = model.new_cache(b, max_len)
    return time_ms(lambda: model.prefill(toks, cache, pos, rope, valid), 10)


def decode_ms(model, batch: int, context: int, data: str, steps: int = 100) -> float:
    max_len = context + steps + 16
    dev = DEVICE
    cache = model.new_cache(batch, max_len)
    toks = real_tokens(data, batch * context, model.cfg.vocab_size).view(batch, context).to(dev)
    pos = torch.arange(context, device=dev)
    valid = torch.ones(batch, max_len, dtype=torch.bool, device=dev)
    with torch.no_grad():
        model.prefill(toks, cache, pos, pos[None].expand(batch, context), valid)
        step = torch.compile(DecodeStep(model, cache), mode="reduce-overhead")
        nxt = toks[:, -1:].contiguous()
        i = [context]

        def one():
            p = torch.tensor([i[0]], device=dev)
            step(nxt, p, p[None].expand(batch, 1), valid)
            i[0] += 1

        return time_ms(one, steps, warm=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--presets", default="124m")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompts", default="512,2048")
    ap.add_argument("--json")
    ap.add_argument("--cpu-smoke", action="store_true", help="run on the CPU to check the script itself")
    args = ap.parse_args()
    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("decode_latency: no CUDA device; nothing to measure")
        return
    bw = copy_bandwidth() if DEVICE == "cuda" else 1e10
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(json.dumps({"device": name, "copy_GBps": bw / 1e9}), flush=True)
    rows = []
    with torch.no_grad():
        for preset in args.presets.split(","):
            prompts = [int(p) for p in args.prompts.split(",")]
            base, branch = models(preset, max(max(prompts), args.context) + 256)
            for s in prompts:
                toks = real_tokens(args.data, s, base.cfg.vocab_size).view(1, s).to(DEVICE)
                tb = prefill_ms(base, toks, s + 8)
                tp = prefill_ms(branch, toks, s + 8)  # the first branch row runs inside the prefill
                r = {"kind": "prefill", "preset": preset, "prompt": s, "baseline_ms": tb, "branch_ms": tp,
                     "ratio": tp / tb}
                rows.append(r)
                print(json.dumps(r), flush=True)
            for bsz in [int(b) for b in args.batches.split(",")]:
                tb = decode_ms(base, bsz, args.context, args.data)
                tbr = decode_ms(branch, bsz, args.context, args.data)
                roof_b = decode_bytes_per_step(base.cfg, args.context, bsz) / bw * 1e3
                roof_d = decode_bytes_per_step(branch.cfg, args.context, bsz) / bw * 1e3
                r = {"kind": "decode", "preset": preset, "batch": bsz, "context": args.context, "baseline_ms": tb,
                     "branch_ms": tbr, "ratio": tbr / tb, "roofline_baseline_ms": roof_b,
                     "roofline_branch_ms": roof_d, "baseline_frac_of_roofline": roof_b / tb,
                     "branch_frac_of_roofline": roof_d / tbr}
                rows.append(r)
                print(json.dumps(r), flush=True)
            del base, branch
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    print("\n| preset | phase | shape | baseline ms | decode-branch ms | ratio | roofline ms (base / branch) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "prefill":
            print(f"| {r['preset']} | prefill | prompt {r['prompt']} | {r['baseline_ms']:.3f} | "
                  f"{r['branch_ms']:.3f} (incl. first branch row) | {r['ratio']:.3f} | - |")
        else:
            print(f"| {r['preset']} | decode | batch {r['batch']}, ctx {r['context']} | {r['baseline_ms']:.3f} | "
                  f"{r['branch_ms']:.3f} | {r['ratio']:.3f} | {r['roofline_baseline_ms']:.3f} / "
                  f"{r['roofline_branch_ms']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    os._exit(0)


if __name__ == "__main__":
    main()
