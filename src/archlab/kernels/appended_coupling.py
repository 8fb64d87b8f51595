"""The decode branch's coupling on a prefill's appended rows, in place: one op, one small kernel.

A branch prefill appends each prompt's first follower rows to the time axis ([B, T + n]); at
every coupling site (``q``, ``u``, ``m``) follower row ``r`` adds ``a[r]`` times the primary's
activation at the prompt's last token::

    x[b, T + r, :] += a[r, :] * x[b, lengths[b] - 1, :]

Written as an ordinary in-place assignment, ``torch.compile`` cannot prove that the anchor rows
it reads lie outside the rows it writes (the anchor is data), so inductor kept both: it wrote
the whole activation, read it back and wrote a new one, in a kernel fused into the activation's
producer. Profiled on an H200 at 124m (docs/benchmarks.md, eighth session) that cost about
0.33 ms of the 0.45 ms the appended rows add to a 2048-token prefill. As a custom op that
declares the mutation of ``x``, inductor runs the producer as the baseline does and then this op
on its output buffer in place (checked in the generated code: no copy, the q site mutates the
fused qkv matmul's output directly). On CUDA the op is one Triton kernel over the ``B * n``
appended rows; elsewhere it runs the same arithmetic eagerly.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton: the eager body serves
    triton = None


def _couple_eager(x: Tensor, a: Tensor, lengths: Tensor) -> None:
    n = a.shape[0]
    src = x[torch.arange(x.shape[0], device=x.device), lengths - 1]  # [B, D] (a copy)
    x[:, x.shape[1] - n:] += (a[None] * src[:, None]).to(x.dtype)


if triton is not None:
    @triton.jit
    def _couple_kernel(x_ptr, a_ptr, len_ptr, stride_xb, stride_xt, stride_ab, T, D,
                       N: tl.constexpr, BLOCK: tl.constexpr):
        """One program per appended row (sequence b, branch r): fp32 arithmetic, x's dtype stored."""
        pid = tl.program_id(0)
        b = pid // N
        r = pid % N
        src_t = tl.load(len_ptr + b) - 1
        src = x_ptr + b * stride_xb + src_t * stride_xt
        dst = x_ptr + b * stride_xb + (T + r) * stride_xt
        for d0 in range(0, D, BLOCK):
            cols = d0 + tl.arange(0, BLOCK)
            ok = cols < D
            s = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
            t = tl.load(dst + cols, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(a_ptr + r * stride_ab + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(dst + cols, (t + w * s).to(dst.dtype.element_ty), mask=ok)


def launch_kernel(x: Tensor, a: Tensor, lengths: Tensor) -> None:
    """The Triton kernel (CUDA, or Triton's CPU interpreter in tests)."""
    n, d = a.shape
    _couple_kernel[(x.shape[0] * n,)](x, a, lengths.contiguous(), x.stride(0), x.stride(1), a.stride(0),
                                      x.shape[1] - n, d, N=n, BLOCK=1024, num_warps=4)


@torch.library.custom_op("archlab::couple_appended_", mutates_args=("x",))
def couple_appended_(x: Tensor, a: Tensor, lengths: Tensor) -> None:
    """``x`` [B, T + n, D] (last dimension contiguous; a view is fine), ``a`` [n, D], ``lengths``
    [B] prompt lengths in ``1..T``: ``x[b, T + r] += a[r] * x[b, lengths[b] - 1]``. The prompt
    lengths themselves (a graph input), not positions computed from them: inductor hands an op
    only realised buffers, and it computed ``lengths - 1`` again for every site."""
    n, d = a.shape
    if x.stride(2) != 1 or a.stride(1) != 1 or x.shape[2] != d or lengths.shape != (x.shape[0],):
        raise ValueError(f"couple_appended_: x {tuple(x.shape)}, a {tuple(a.shape)}, lengths {tuple(lengths.shape)}")
    if x.is_cuda and triton is not None:
        launch_kernel(x, a, lengths)
    else:
        _couple_eager(x, a, lengths)


@couple_appended_.register_fake
def _(x: Tensor, a: Tensor, lengths: Tensor) -> None:
    return None
