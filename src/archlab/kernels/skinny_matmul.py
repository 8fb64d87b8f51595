"""Skinny matmul: ``x [M, K] @ w[N, K].T`` for the few rows of a decode step, in one Triton kernel.

A decode step at batch 1 to 8 multiplies a handful of rows by every weight of the model, so its
time is the time to read the weights. On an H200 cuBLAS reads a 1b model's 8-22 MB weights at
34-49% of the copy bandwidth and a 124m model's 1-6 MB ones at 7-31%, while the 206 MB
unembedding reaches 98% (``benchmarks/gemv_bandwidth.py``, docs/benchmarks.md, eighth session):
the small ones are bound by how fast a kernel ramps up and drains, not by the bytes. This kernel
is a plain weight-streaming GEMV:

* one program per ``BLOCK_N`` output features streams those weight rows over all of ``K``
  (contiguous in memory) and keeps the ``M`` rows' partial sums in registers, so every weight
  byte is read once whatever ``M`` is;
* for up to ``DOT_MIN_ROWS - 1`` rows it multiplies on the CUDA cores (a broadcast product
  summed over ``K``: no tensor-core tile to pad to 16 rows, no shared-memory staging, and
  ``BLOCK_N`` can be as small as 4, so a 768-wide output still spreads over 192 programs);
  from ``DOT_MIN_ROWS`` rows on it uses ``tl.dot``;
* the block sizes are autotuned per shape (``triton.autotune``, whose timing flushes the L2
  cache between runs, as a decode step's weights are never L2-resident).

``gated=True`` takes SwiGLU's ``[gate | up]`` activation ``x [M, 2K]`` and multiplies
``silu(gate) * up`` by ``w``, the product formed as each block of ``x`` is loaded (in fp32,
rounded once to ``x``'s dtype, as inductor's fused pointwise kernel rounds it): the decode step's
``w_down`` then needs no kernel of its own for the gating, and the gated activation is never
written.

Whether it beats cuBLAS for a shape is measured, not assumed: ``benchmarks/gemv_bandwidth.py``
times both; ``layers.DECODE_LINEAR`` decides whether a decode step uses it. The kernel runs on
CUDA and, for tests, in Triton's CPU interpreter (one fixed configuration there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing
from torch import Tensor

from archlab.kernels import interpreting

MAX_ROWS = 16  # more rows than this are a prefill's, for cuBLAS
DOT_MIN_ROWS = 5  # from this many rows on, tensor cores (tiles of 16 rows)


@triton.jit
def _skinny_matmul_kernel(
    x_ptr, w_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
    M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, FP32_DOT: tl.constexpr, GATED: tl.constexpr, EVEN: tl.constexpr,
):
    """One program per ``BLOCK_N`` output features: their weight rows streamed over ``K``, the
    ``M`` input rows' sums in fp32 registers. ``GATED``: row ``m`` of the input is
    ``silu(x[m, :K]) * x[m, K:]``."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: unmasked, vectorised weight loads
            w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :])
        else:
            w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & (k < K)[None, :],
                        other=0.0)
        x_at = x_ptr + m[:, None] * stride_xm + k[None, :]
        x_ok = m_ok[:, None] & (k < K)[None, :]
        x = tl.load(x_at, mask=x_ok, other=0.0)
        if GATED:  # x holds the gate; the up projection is K columns further
            g = x.to(tl.float32)
            up = tl.load(x_at + K, mask=x_ok, other=0.0).to(tl.float32)
            x = (g * tl.sigmoid(g) * up).to(x_ptr.dtype.element_ty)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif USE_DOT:
            acc += tl.dot(x, tl.trans(w))
        else:  # [BLOCK_M, 1, BLOCK_K] * [1, BLOCK_N, BLOCK_K], summed over K
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _configs() -> list[triton.Config]:
    """Block sizes to try: small ``BLOCK_N`` spreads a narrow output over more programs, a long
    ``BLOCK_K`` keeps more bytes in flight per program."""
    out = []
    for bn, bk, warps in ((4, 512, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8),
                          (32, 256, 8), (32, 128, 4), (64, 128, 4)):
        for stages in (1, 3):
            out.append(triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages))
    return out


def _prune(configs, named_args, **kwargs):
    """Drop blocks that the shape cannot use: tensor-core tiles need ``BLOCK_N`` >= 16, and a
    ``BLOCK_K`` longer than ``K`` only masks."""
    k = named_args["K"]
    use_dot = kwargs.get("USE_DOT", named_args.get("USE_DOT"))
    kept = [c for c in configs if (not use_dot or c.kwargs["BLOCK_N"] >= 16)
            and c.kwargs["BLOCK_K"] <= max(128, triton.next_power_of_2(k))]
    return kept or configs[-1:]


# EVEN follows from the shape and the configuration that autotuning picks.
_kernel = triton.heuristics({"EVEN": lambda a: a["N"] % a["BLOCK_N"] == 0 and a["K"] % a["BLOCK_K"] == 0})(
    _skinny_matmul_kernel)


def _quick_bench(kernel_call, quantiles):
    """Time one configuration for 5 + 20 ms, not Triton's default 25 + 100: these kernels run for
    2-60 us, so 20 ms still averages hundreds of runs. By arithmetic (not timed yet), the default
    costs 5 weight shapes x 18 configurations x 125 ms, about 11 s, at the start of every batch-1
    ``archlab generate``: about what a warm eager run spent in generate on the H200 (8.4 s)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def _tuning_options() -> dict:
    """Where this Triton has them: the quick timing above, and the choices kept on disk in
    Triton's cache (``cache_results``), so that a later process reads them instead of tuning
    again (the cache key holds the kernel's source, the configurations, the GPU and the shape)."""
    import inspect

    params = inspect.signature(triton.runtime.autotuner.Autotuner.__init__).parameters
    return {k: v for k, v in (("do_bench", _quick_bench), ("cache_results", True)) if k in params}


_tuned_kernel = triton.autotune(configs=_configs(), key=["N", "K", "M", "GATED"],
                                prune_configs_by={"early_config_prune": _prune}, **_tuning_options())(_kernel)


def skinny_matmul_reference(x: Tensor, w: Tensor, gated: bool = False) -> Tensor:
    """Eager ground truth: ``x @ w.T`` in fp32, returned in ``x``'s dtype (``gated``: of
    ``silu(gate) * up``, rounded to ``x``'s dtype first, as the kernel rounds it)."""
    if gated:
        g, up = x.float().chunk(2, dim=-1)
        x = (torch.nn.functional.silu(g) * up).to(x.dtype)
    return (x.float() @ w.float().T).to(x.dtype)


def skinny_matmul(x: Tensor, w: Tensor, gated: bool = False) -> Tensor:
    """``x [..., K] @ w.T`` for ``w`` [N, K] with a contiguous last dimension and at most
    ``MAX_ROWS`` rows in ``x``; returns ``[..., N]`` in ``x``'s dtype (fp32 accumulation).
    ``gated``: ``x`` is ``[..., 2K]``, SwiGLU's gate then up, and the product is of
    ``silu(gate) * up``.

    A custom op, so ``torch.compile`` keeps it as one opaque call (autotuning happens at its
    first eager run, before a CUDA graph captures it) instead of tracing the Triton launch.
    Outside a compiled graph the launch is called directly: the first call of any
    ``torch.library.custom_op`` imports ``torch._dynamo``, which an eager ``archlab generate``
    otherwise never needs (4.2 s of a warm 12 s run on the H200 machine's image, with its
    compilation: docs/benchmarks.md, seventeenth session)."""
    *lead, width = x.shape
    k = width // 2 if gated else width
    if w.dim() != 2 or w.shape[1] != k or w.stride(1) != 1 or (gated and width != 2 * k):
        raise ValueError(f"skinny_matmul: x {tuple(x.shape)} does not fit w {tuple(w.shape)} (or w is strided)"
                         + (" with gated=True (x holds gate and up)" if gated else ""))
    rows = x.numel() // width if width else 0
    if not 0 < rows <= MAX_ROWS:
        raise ValueError(f"skinny_matmul: {rows} rows; 1 to {MAX_ROWS}")
    launch = torch.ops.archlab.skinny_matmul if torch.compiler.is_compiling() else _skinny_matmul_launch
    return launch(x.reshape(rows, width), w, gated).view(*lead, w.shape[0])


def _skinny_matmul_launch(x: Tensor, w: Tensor, gated: bool = False) -> Tensor:
    """The kernel's launch on ``x`` [M, K] (``gated``: [M, 2K]) and ``w`` [N, K]: the custom
    op's body."""
    m = x.shape[0]
    n, k = w.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    x2 = x
    use_dot = m >= DOT_MIN_ROWS
    block_m = 16 if use_dot else triton.next_power_of_2(m)
    args = (x2, w, out, n, k, x2.stride(0), w.stride(0), out.stride(0))
    # fp32 multiplies in full fp32 (not tf32); so does bf16 in Triton's CPU interpreter, whose
    # bf16 ``tl.dot`` is wrong (as in ``decode_attention``): bf16 converts to fp32 exactly.
    fp32_dot = use_dot and (x.dtype == torch.float32 or interpreting())
    if interpreting():  # one configuration, large blocks: the interpreter's cost is per block
        bn, bk = max(16, min(64, triton.next_power_of_2(n))), max(16, min(256, triton.next_power_of_2(k)))
        _kernel[(triton.cdiv(n, bn),)](*args, M=m, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, USE_DOT=use_dot,
                                      FP32_DOT=fp32_dot, GATED=gated)
    else:
        _tuned_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, M=m, BLOCK_M=block_m, USE_DOT=use_dot,
                                                                        FP32_DOT=fp32_dot, GATED=gated)
    return out


@torch.library.custom_op("archlab::skinny_matmul", mutates_args=())
def _skinny_matmul_op(x: Tensor, w: Tensor, gated: bool = False) -> Tensor:
    return _skinny_matmul_launch(x, w, gated)


@_skinny_matmul_op.register_fake
def _(x: Tensor, w: Tensor, gated: bool = False) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])
