"""Time to first token of the Decode-Branch model against the baseline, measured so that it holds.

    python benchmarks/ttft_protocol.py --presets 124m,1b --prompt 2048 --pairs 30

One pair of timings is not a measurement: on an H200 the baseline's prefill time was seen to be
bimodal from one call to the next (branch / baseline 1.224 in one call, 1.098 in another). So the
two models run in alternation (``archlab.infer.bench.paired_ttft``): ``--pairs`` pairs, each a fresh
prompt of the same length given to both, the order swapped from pair to pair, and the table gives
each model's median with its interquartile range and the median of the per-pair ratios with
theirs. Both models of a preset share every weight but the branch's own tensors (the branch's
coupling vectors random, as trained ones are non-zero), bf16 on CUDA, float32 on CPU.

On CPU (a check that the script works): ``--presets tiny --prompt 128 --pairs 6 --device cpu``.
Prints a Markdown table and one JSON object per preset.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from archlab.infer.bench import as_dict, baseline_and_branch, paired_ttft  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="124m,1b")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--pairs", type=int, default=30, help="alternating pairs per preset (default 30)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    with torch.no_grad():
        for preset in args.presets.split(","):
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            base, branch = baseline_and_branch(preset, max(args.prompt + 16, 1024), [], device, dtype)
            r = as_dict(paired_ttft(base, branch, args.prompt, pairs=args.pairs))
            rows.append({"preset": preset, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                         else "cpu", **r})
            del base, branch
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print("| preset | prompt | pairs | baseline ms (IQR) | branch ms (IQR) | branch / baseline (IQR) |")
    print("|---|---:|---:|---|---|---|")
    for r in rows:
        a, b, q = r["a_iqr_ms"], r["b_iqr_ms"], r["ratio_iqr"]
        print(f"| {r['preset']} | {r['prompt']} | {r['pairs']} | {r['a_ms']:.3f} ({a[0]:.3f}-{a[1]:.3f}) | "
              f"{r['b_ms']:.3f} ({b[0]:.3f}-{b[1]:.3f}) | {r['ratio']:.3f} ({q[0]:.3f}-{q[1]:.3f}) |")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
