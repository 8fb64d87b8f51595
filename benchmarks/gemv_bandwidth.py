"""How close a decode step's matrix-vector products come to the copy bandwidth, per weight shape.

    python benchmarks/gemv_bandwidth.py --preset 1b --batches 1,8

A decode step at batch 1 to 8 is a chain of skinny matmuls (``x [B, d] @ W.T``), each of which
must read its whole weight once; the step's roofline assumes they read at the copy bandwidth. This
times each distinct weight shape of a preset's layer (and the unembedding) the way the engine's
graph-captured step runs them, back to back inside one CUDA graph of ``--reps`` calls, so launch
gaps count as they do in decoding, and prints the achieved bytes/s against the measured copy
bandwidth. ``--kernels cublas,skinny`` times each shape with cuBLAS (``torch.matmul``) and with
archlab's Triton GEMV (``kernels/skinny_matmul.py``, autotuned per shape before capture). The calls cycle through copies of the weight that add up to at least 512 MB: one
weight read again and again would come from the L2 cache (50-60 MB on an H100/H200; a first
version of this script reported 120% of the copy bandwidth that way). Prints a Markdown table;
``--json`` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from archlab.config import PRESETS, make_config  # noqa: E402
from archlab.infer.bench import copy_bandwidth  # noqa: E402
from archlab.kernels.skinny_matmul import MAX_ROWS, skinny_matmul  # noqa: E402
from archlab.model.core.spec import layer_specs  # noqa: E402


def shapes(preset: str) -> list[tuple[str, int, int]]:
    """(name, in features, out features) of the first layer's weights and the unembedding."""
    cfg = make_config(preset).model
    s = layer_specs(cfg)[0]
    return [("wqkv", s.d, s.q_dim + 2 * s.kv_dim), ("wo", s.q_dim, s.d), ("w_gate_up", s.d, 2 * s.hidden),
            ("w_down", s.hidden, s.d), ("lm_head", s.d, cfg.vocab_size)]


def graph_ms(fn, reps: int) -> float:
    """Milliseconds per call of ``fn`` replayed ``reps`` times in one captured CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--kernels", default="cublas", help="comma-separated: cublas, skinny")
    ap.add_argument("--json")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    if not kernels or not set(kernels) <= {"cublas", "skinny"}:
        ap.error(f"--kernels: comma-separated cublas, skinny; got {args.kernels!r}")
    try:
        batches = [int(x) for x in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches: comma-separated integers, got {args.batches!r}")
    if min(batches) < 1 or args.reps < 1:
        ap.error("--batches and --reps must be positive")
    if not torch.cuda.is_available():
        print("gemv_bandwidth: no CUDA device; nothing to measure")
        return
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    rows = []
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| weight | shape (in x out) | MB | batch | kernel | us per call | TB/s | of copy bandwidth |")
    print("|---|---|---|---|---|---|---|---|")
    for name, k, n in shapes(args.preset):
        nbytes = n * k * 2
        copies = max(2, -(-(512 << 20) // nbytes))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        reps = copies * max(1, args.reps // copies)
        for b, kernel in [(b, kn) for b in batches for kn in kernels]:
            x = torch.randn(b, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(b, n, device=dev, dtype=torch.bfloat16)
            turn = iter(range(1 << 30))

            def call():  # the next copy at each call (captured in order, replayed in order)
                w = weights[next(turn) % copies]
                if kernel == "skinny":
                    skinny_matmul(x, w)
                else:
                    torch.matmul(x, w.t(), out=out)

            if kernel == "skinny" and b > MAX_ROWS:
                continue
            ms = graph_ms(call, reps)
            r = {"weight": name, "in": k, "out": n, "batch": b, "kernel": kernel, "us": ms * 1e3,
                 "TBps": nbytes / (ms / 1e3) / 1e12, "frac_of_copy": nbytes / (ms / 1e3) / bw}
            rows.append(r)
            print(f"| {name} | {k} x {n} | {nbytes / 1e6:.1f} | {b} | {kernel} | {r['us']:.1f} | {r['TBps']:.2f} | "
                  f"{r['frac_of_copy']:.1%} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
