"""A decode step's RoPE of q and k and both KV-cache writes, in one Triton kernel.

Around a decode step's ``wqkv`` GEMV, inductor launched three short kernels per layer: RoPE of k
fused with its cache write, the cache write of v, and RoPE of q. Each moves a few kilobytes and
costs its launch and memory latency, 0.8-1.8 us on an H200 (``benchmarks/kernel_timeline.py``,
docs/benchmarks.md, eighth session): about 4 us of a 1b layer's 60. Here one launch does all
three:

* program ``(r, j)`` handles head ``j`` of row ``r``: query heads ``0..H-1`` rotate ``q`` into a
  new ``[R, H, 1, hd]`` tensor; key/value heads ``H..H+KVH-1`` of a primary row (``r < B``) rotate
  ``k`` and copy ``v`` into the cache at ``(cache_rows[r], head, positions[r])``;
* follower rows (the decode branch's, ``r >= B``) belong to sequence ``r % B``: its position's
  cos/sin, and no keys or values of their own;
* arithmetic in fp32, rounded once to the output's dtype, as ``layers.apply_rope`` does.

The op mutates the two cache buffers and returns the rotated queries. Inside ``torch.compile`` it
is a ``torch.library`` custom op that declares those mutations, so inductor writes the cache in
place (no copy of a buffer: ``tests/kernels/test_rope_cache.py`` reads the generated code);
outside, the launch is called directly (importing ``torch._dynamo`` costs an eager
``archlab generate`` seconds: ``kernels.skinny_matmul``). ``layers.DECODE_ROPE`` decides whether
a decode step uses it (off by default: in a CUDA-graphed batch-1 step on an H100 it changed the
step time by -0.6% at 124m and +1.5% at 1b, docs/benchmarks.md, thirtieth session). It runs on
CUDA and, for tests, in Triton's CPU interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, crow_ptr, qo_ptr, kc_ptr, vc_ptr,
    B, stride_q, stride_k, stride_v, stride_cs, stride_pos,
    stride_cb, stride_ch, stride_cl, stride_vb, stride_vh, stride_vl,
    H: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    r = tl.program_id(0)
    j = tl.program_id(1)
    b = r % B
    d = tl.arange(0, BLOCK)
    ok = d < HALF
    cos = tl.load(cos_ptr + b * stride_cs + d, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + b * stride_cs + d, mask=ok, other=0.0).to(tl.float32)
    if j < H:  # a query head of row r
        src = q_ptr + r * stride_q + j * (2 * HALF)
        x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=ok, other=0.0).to(tl.float32)
        dst = qo_ptr + (r * H + j) * (2 * HALF)
        tl.store(dst + d, (x1 * cos - x2 * sin).to(qo_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + d, (x2 * cos + x1 * sin).to(qo_ptr.dtype.element_ty), mask=ok)
    elif r < B:  # a key/value head of a primary row: into the cache at its row and position
        h = j - H
        pos = tl.load(pos_ptr + r * stride_pos).to(tl.int64)
        if HAS_ROWS:
            crow = tl.load(crow_ptr + r).to(tl.int64)
        else:  # sequence r in cache row r
            crow = r.to(tl.int64)
        src = k_ptr + r * stride_k + h * (2 * HALF)
        x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=ok, other=0.0).to(tl.float32)
        dst = kc_ptr + crow * stride_cb + h * stride_ch + pos * stride_cl
        tl.store(dst + d, (x1 * cos - x2 * sin).to(kc_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + d, (x2 * cos + x1 * sin).to(kc_ptr.dtype.element_ty), mask=ok)
        vsrc = v_ptr + r * stride_v + h * (2 * HALF)
        vdst = vc_ptr + crow * stride_vb + h * stride_vh + pos * stride_vl
        va = tl.load(vsrc + d, mask=ok, other=0.0)
        vb = tl.load(vsrc + HALF + d, mask=ok, other=0.0)
        tl.store(vdst + d, va.to(vc_ptr.dtype.element_ty), mask=ok)
        tl.store(vdst + HALF + d, vb.to(vc_ptr.dtype.element_ty), mask=ok)


def rope_cache_reference(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
                         cache_rows: Tensor | None, k_cache: Tensor, v_cache: Tensor, n_heads: int) -> Tensor:
    """Eager ground truth (in float64 when the inputs are): the arithmetic of ``layers.apply_rope``
    and ``KVCache.write``, row by row."""
    rows, batch = q.shape[0], k.shape[0]
    hd = k_cache.shape[3]
    half = hd // 2

    def rot(x, b):  # x [heads, hd] of sequence b
        c, s = cos[b].reshape(half).to(torch.float64), sin[b].reshape(half).to(torch.float64)
        x1, x2 = x[:, :half].to(torch.float64), x[:, half:].to(torch.float64)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    out = torch.empty(rows, n_heads, 1, hd, dtype=q.dtype, device=q.device)
    for r in range(rows):
        out[r, :, 0] = rot(q[r].reshape(n_heads, hd), r % batch).to(q.dtype)
    kvh = k_cache.shape[1]
    for b in range(batch):
        row, pos = b if cache_rows is None else int(cache_rows[b]), int(positions[b].reshape(-1)[0])
        k_cache[row, :, pos] = rot(k[b].reshape(kvh, hd), b).to(k_cache.dtype)
        v_cache[row, :, pos] = v[b].reshape(kvh, hd).to(v_cache.dtype)
    return out


def _check(q, k, v, cos, sin, positions, cache_rows, k_cache, v_cache, n_heads) -> None:
    rows, batch = q.shape[0], k.shape[0]
    _, kvh, slots, hd = k_cache.shape
    problems = []
    if hd % 2 or q.shape[-1] != n_heads * hd or k.shape[-1] != kvh * hd or v.shape != k.shape:
        problems.append(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                        f"{n_heads} heads and a cache {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or batch == 0 or rows % batch:
        problems.append(f"cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)}, {rows} rows of {batch} sequences")
    if cos.shape[0] != batch or cos.shape[-1] != hd // 2 or sin.shape != cos.shape:
        problems.append(f"cos/sin {tuple(cos.shape)} for {batch} sequences of head dim {hd}")
    if positions.shape[0] != batch or positions.numel() != batch or (
            cache_rows is not None and cache_rows.shape != (batch,)):
        problems.append(f"positions {tuple(positions.shape)}, cache rows "
                        f"{None if cache_rows is None else tuple(cache_rows.shape)} for {batch} sequences")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos, sin, k_cache, v_cache)):
        problems.append("every tensor needs a contiguous last dimension")
    if problems:
        raise ValueError("rope_cache: " + "; ".join(problems))


def rope_cache_launch(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
                      cache_rows: Tensor | None, k_cache: Tensor, v_cache: Tensor, n_heads: int) -> Tensor:
    """The kernel's launch: the custom op's body (and the eager path)."""
    rows, batch = q.shape[0], k.shape[0]
    kvh, hd = k_cache.shape[1], k_cache.shape[3]
    q2, k2, v2 = q.reshape(rows, -1), k.reshape(batch, -1), v.reshape(batch, -1)
    cos2, sin2 = cos.reshape(batch, -1), sin.reshape(batch, -1)
    pos = positions.reshape(batch)
    out = torch.empty(rows, n_heads, 1, hd, device=q.device, dtype=q.dtype)
    _rope_cache_kernel[(rows, n_heads + kvh)](
        q2, k2, v2, cos2, sin2, pos, pos if cache_rows is None else cache_rows, out, k_cache, v_cache,
        batch, q2.stride(0), k2.stride(0), v2.stride(0), cos2.stride(0), pos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), H=n_heads, HALF=hd // 2, BLOCK=triton.next_power_of_2(hd // 2),
        HAS_ROWS=cache_rows is not None, num_warps=1)
    return out


def rope_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
               cache_rows: Tensor | None, k_cache: Tensor, v_cache: Tensor, n_heads: int) -> Tensor:
    """One decode step's rotated queries ``[R, H, 1, hd]``, its keys rotated and its values
    written into ``k_cache``/``v_cache`` ``[rows, KVH, slots, hd]`` in place.

    ``q`` [R, 1, H*hd] for R rows (B primary rows, then any followers of sequence ``r % B``),
    ``k``/``v`` [B, 1, KVH*hd] (views of the fused qkv output are fine), ``cos``/``sin``
    [B, 1, hd/2] at each sequence's position (fp32), ``positions`` [B, 1], ``cache_rows`` [B]:
    the cache row of each sequence (None: sequence ``b`` in row ``b``)."""
    _check(q, k, v, cos, sin, positions, cache_rows, k_cache, v_cache, n_heads)
    if torch.compiler.is_compiling():
        return torch.ops.archlab.rope_cache_(q, k, v, cos, sin, positions, cache_rows, k_cache, v_cache, n_heads)
    return rope_cache_launch(q, k, v, cos, sin, positions, cache_rows, k_cache, v_cache, n_heads)


@torch.library.custom_op("archlab::rope_cache_", mutates_args=("k_cache", "v_cache"))
def _rope_cache_op(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
                   cache_rows: Tensor | None, k_cache: Tensor, v_cache: Tensor, n_heads: int) -> Tensor:
    return rope_cache_launch(q, k, v, cos, sin, positions, cache_rows, k_cache, v_cache, n_heads)


@_rope_cache_op.register_fake
def _(q, k, v, cos, sin, positions, cache_rows, k_cache, v_cache, n_heads):
    return q.new_empty(q.shape[0], n_heads, 1, k_cache.shape[3])
