"""Benchmark and check the depth-routing (AttnRes / MHAR) implementations on a GPU.

For training-like shapes it first checks the Triton forward and backward against the eager
reference (relative error ``||a - b|| / ||b||`` of out, dsources, dquery, dgain; shown on the
Triton rows), then times
the reference, ``torch.compile`` and Triton versions, forward alone and forward + backward, with
``triton.testing.do_bench`` (median), and prints a markdown table.

Bandwidth: routing is memory-bound, so each time is also shown as GB/s over the minimum traffic
of the op. Forward: the sources read once plus the output written once, ``(N + 1) * M * d``
elements. Forward + backward adds the backward's minimum: the upstream gradient and the
sources read once, the source gradients written once, ``(2N + 1) * M * d`` more.

``--tiles 1:2 2:4 ...`` also times the Triton kernels with other tiles (rows per program and
warps, for both kernels), the way ``routing_triton._tiles`` was tuned. ``--accumulate`` times the
Triton backward as the model runs it, adding into a gradient buffer; ``--impls triton-tail``
routes the last source as the kernels' tail operand, as Block AttnRes does with a partial sum.

Run on a CUDA machine: ``PYTHONPATH=src python benchmarks/attnres_kernels.py`` (``--help`` for
a smaller sweep). Without CUDA it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable

import torch

EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom > 0 else (a - b).norm().item()


def fwd_bwd(fn: Callable[..., torch.Tensor], sources: torch.Tensor, query: torch.Tensor,
            gain: torch.Tensor, heads: int, dout: torch.Tensor) -> list[torch.Tensor]:
    """``[out, dsources, dquery, dgain]`` of ``fn`` for the upstream gradient ``dout``."""
    s, q, g = (x.detach().clone().requires_grad_() for x in (sources, query, gain))
    out = fn(s, q, g, heads, EPS)
    out.backward(dout)
    return [out.detach(), s.grad, q.grad, g.grad]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, default=8 * 1024, help="positions B*T")
    parser.add_argument("--d", type=int, nargs="+", default=[768, 1024])
    parser.add_argument("--n", type=int, nargs="+", default=[9, 25, 49])
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--impls", nargs="+", choices=["reference", "compile", "triton", "triton-tail"],
                        default=["reference", "compile", "triton"],
                        help="implementations to time; triton-tail passes the last source as the "
                             "kernels' tail operand, as Block AttnRes passes a partial sum")
    parser.add_argument("--tiles", nargs="+", default=[], metavar="BM:WARPS",
                        help="also time the Triton kernels with these tiles")
    parser.add_argument("--accumulate", action="store_true",
                        help="time the Triton backward as the model runs it: adding into a "
                             "gradient buffer (load-add-store) instead of writing fresh gradients")
    args = parser.parse_args()
    try:
        tiles = [tuple(int(v) for v in t.split(":")) for t in args.tiles]
        if any(len(t) != 2 or min(t) < 1 for t in tiles):
            raise ValueError
    except ValueError:
        parser.error(f"--tiles takes ROWS:WARPS pairs of positive integers, got {args.tiles}")

    if not torch.cuda.is_available():
        print("attnres_kernels: no CUDA device; nothing to benchmark")
        return 0

    import triton.testing

    from archlab.kernels.routing_compiled import route_compiled
    from archlab.kernels.routing_reference import route_reference
    from archlab.kernels import routing_triton
    from archlab.kernels.routing_triton import route_triton

    # Every (dtype, heads) pair is a fresh graph for torch.compile; the default recompile limit
    # (8) would silently send the later configurations to eager.
    torch._dynamo.config.recompile_limit = 256
    # Inductor's note that it split a reduction would interleave with the table.
    warnings.filterwarnings("ignore", message="Online softmax is disabled")
    default_tiles = routing_triton._tiles
    impls: dict[str, Callable[..., torch.Tensor]] = {
        "reference": route_reference, "compile": route_compiled, "triton": route_triton,
        "triton-tail": lambda s, q, g, h, eps: route_triton(s[:-1], q, g, h, eps, tail=s[-1])}
    checked = [name for name in ("triton", "triton-tail") if name in args.impls] or ["triton"]
    device = torch.device("cuda")
    print(f"# Depth routing on {torch.cuda.get_device_name(device)}; torch {torch.__version__}, "
          f"triton {triton.__version__}; M = {args.m} positions\n")
    print("| dtype | d | N | H | err out | err ds | err dq | err dg | impl | fwd ms | fwd GB/s "
          "| fwd+bwd ms | fwd+bwd GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for d in args.d:
            for n in args.n:
                for heads in args.heads:
                    gen = torch.Generator(device=device).manual_seed(n * 1000 + d + heads)
                    sources = torch.randn(n, args.m, d, device=device, generator=gen).to(dtype)
                    query = 0.1 * torch.randn(d, device=device, generator=gen)
                    gain = 1 + 0.1 * torch.randn(d, device=device, generator=gen)
                    dout = torch.randn(args.m, d, device=device, generator=gen).to(dtype)

                    want = fwd_bwd(route_reference, sources, query, gain, heads, dout)
                    err_cells = {}
                    for name in checked:
                        got = fwd_bwd(impls[name], sources, query, gain, heads, dout)
                        errs = [rel_err(a, b) for a, b in zip(got, want)]
                        if dtype == torch.float32:
                            worst = max(worst, *errs)
                        err_cells[name] = " | ".join(f"{e:.1e}" for e in errs)
                        del got
                    del want

                    elem = sources.element_size()
                    fwd_bytes = (n + 1) * args.m * d * elem
                    bwd_bytes = (2 * n + 1) * args.m * d * elem
                    leaves = [x.detach().clone().requires_grad_() for x in (sources, query, gain)]
                    grad_buf = torch.zeros_like(sources) if args.accumulate else None
                    runs = [(name, None) for name in args.impls]
                    runs += [("triton", tile) for tile in tiles]
                    for name, tile in runs:
                        fn = impls[name]
                        if tile is not None:
                            t = routing_triton._tiles(args.m, d, heads, device)
                            routing_triton._tiles = (lambda *_a, t=t, tile=tile: routing_triton._Tiles(
                                tile[0], t.block_h, t.block_dh, tile[1], tile[1]))
                            name = f"triton {tile[0]}:{tile[1]}"

                        # The tail variant's backward is timed on its own leaves (stack, tail,
                        # query, gain): through slices of one leaf, autograd's slicing backward
                        # (zero-fill and copy of the whole stack) would dominate the time.
                        run_leaves = leaves
                        if name == "triton-tail":
                            run_leaves = [x.detach().clone().requires_grad_()
                                          for x in (sources[:-1], sources[-1], query, gain)]

                        def forward() -> torch.Tensor:
                            with torch.no_grad():
                                return fn(sources, query, gain, heads, EPS)

                        def forward_backward() -> None:
                            if args.accumulate and name.startswith("triton"):
                                out, w = routing_triton._route_forward(sources, query, gain, heads, EPS)
                                routing_triton.route_backward(sources, query, gain, w, out, dout, heads,
                                                               EPS, accumulate_into=grad_buf)
                                return
                            if name == "triton-tail":
                                stack, tail, q, g = run_leaves
                                out = route_triton(stack, q, g, heads, EPS, tail=tail)
                            else:
                                out = fn(*leaves, heads, EPS)
                            out.backward(dout)

                        forward()  # compile (if any) outside the timed region
                        forward_backward()
                        t_fwd = triton.testing.do_bench(forward, return_mode="median")
                        t_all = triton.testing.do_bench(forward_backward, grad_to_none=run_leaves,
                                                        return_mode="median")
                        cells = err_cells.get(name, "- | - | - | -")
                        print(f"| {dtype_name} | {d} | {n} | {heads} | {cells} | {name} | "
                              f"{t_fwd:.3f} | {fwd_bytes / t_fwd / 1e6:.0f} | {t_all:.3f} | "
                              f"{(fwd_bytes + bwd_bytes) / t_all / 1e6:.0f} |", flush=True)
                        routing_triton._tiles = default_tiles
                    del sources, dout, leaves, grad_buf
                    torch.cuda.empty_cache()
    print(f"\nworst fp32 relative error, {' and '.join(checked)} vs reference: {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
