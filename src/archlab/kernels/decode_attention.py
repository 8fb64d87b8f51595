"""Decode attention: a few new queries per sequence against its static KV cache, in one Triton
kernel (flash-decoding).

A decode step asks, per sequence, ``G`` queries (the primary row and, with the decode branch, its
follower rows, all at the sequence's newest position ``last[b]``) of a cache whose slots up to
that position are filled; a prefill's appended follower rows ask the same of the prompt's keys.
Each query row may have its own last slot (``last`` [B, G]). PyTorch's SDPA needs that as a
boolean mask over every slot of the static cache, and measured on an H200 it then picks its
kernel by the query count: one query gets a decode kernel (5 us per 124m layer), two get a
prefill kernel with 64-row tiles (21 us), so the decode branch's second row cost more than all
its matmuls (docs/benchmarks.md, seventh session). This kernel instead:

* reads each key/value head's filled slots once for every query that uses it: the ``Hq / Hkv``
  query heads of a grouped-query head and the ``G`` rows of the sequence are the ``M`` rows of
  one tile, so one row or several cost the same bytes (the rows cost only tensor-core work that
  the tile pads to 16 rows anyway);
* stops after the furthest of a sequence's last slots instead of masking the rest of the cache
  (no mask tensor is built). It takes the positions themselves (the engine's position buffer,
  any integer dtype), not lengths computed from them: inductor hands a kernel only realised
  buffers, and would compute ``positions + 1`` again for every layer, one more launch each;
* optionally splits the filled slots over ``splits`` programs per head (flash-decoding) so that a
  small batch still occupies the GPU. Given ``counters`` (the KV cache holds them), the last
  program of a head to finish merges the splits' partial softmax sums in the same launch: it
  counts the programs in with an atomic add and leaves the counter at zero for the next launch.
  Without counters a second small kernel merges them; with one split the kernel writes the
  output itself. Splits past every row's length read and write nothing.
* adds an attention sink per query head (a logit with a zero value), as ``layers.sdpa`` does.

Shapes are static, so a CUDA graph captures it; the host computes nothing from the data.
The kernels run on CUDA and, for tests, in Triton's CPU interpreter (``TRITON_INTERPRET=1``);
``decode_attention_reference`` is the eager ground truth.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from archlab.kernels import interpreting

LOG2E = 1.4426950408889634


def decode_attention_reference(q: Tensor, k: Tensor, v: Tensor, last: Tensor,
                               sink: Tensor | None = None) -> Tensor:
    """Eager reference: ``q`` [B, Hq, G, D] against ``k``/``v`` [B, Hkv, S, D], where query row
    ``(b, g)`` sees slots ``<= last[b, g]`` (``last`` [B, G], or [B] or [B, 1] for all rows of
    a sequence); ``sink`` [Hq] one more logit per head with a zero value. Returns [B, Hq, G, D] in
    ``q``'s dtype (computed in fp32)."""
    b, hq, g, d = q.shape
    rep = hq // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * d ** -0.5  # [B, Hq, G, S]
    last = last.reshape(b, -1).expand(b, g)
    visible = torch.arange(k.shape[2], device=q.device) <= last[:, :, None]  # [B, G, S]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sink is not None:
        scores = torch.cat([sink.float().view(1, hq, 1, 1).expand(b, hq, g, 1), scores], dim=-1)
        vf = torch.cat([vf.new_zeros(b, hq, 1, d), vf], dim=2)
    return (scores.softmax(-1) @ vf).to(q.dtype)


@triton.jit
def _merge_partials(part_o_ptr, part_ml_ptr, sink_ptr, pid, head, rows, cols, row_ok, n_active,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, HAS_SINK: tl.constexpr):
    """The output rows of program ``pid`` (sequence x key/value head) from its splits' partial
    softmax sums, rescaled to their common maximum and added; only the first ``n_active`` splits
    hold slots (the others wrote nothing). Every row's maximum is finite, since split 0 holds
    its slot 0; padding rows get 0, never stored. Loads bypass L1 (``.cg``): other programs of
    the same launch wrote these partials."""
    ml = part_ml_ptr + pid * SPLITS * 2 * BLOCK_M
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if HAS_SINK:
        s_sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m = s_sink
    for s in tl.static_range(SPLITS):
        active = (rows * 0 + s) < n_active  # [BLOCK_M]: masks are tensors
        m = tl.maximum(m, tl.load(ml + s * 2 * BLOCK_M + rows, mask=active, other=float("-inf"),
                                  cache_modifier=".cg"))
    m = tl.where(m == float("-inf"), 0.0, m)  # padding rows only (their weights stay 0)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_SINK:
        l = tl.exp2(s_sink - m)
    for s in tl.static_range(SPLITS):
        active = (rows * 0 + s) < n_active
        w = tl.exp2(tl.load(ml + s * 2 * BLOCK_M + rows, mask=active, other=float("-inf"), cache_modifier=".cg") - m)
        l += w * tl.load(ml + s * 2 * BLOCK_M + BLOCK_M + rows, mask=active, other=0.0, cache_modifier=".cg")
        acc += w[:, None] * tl.load(part_o_ptr + (pid * SPLITS + s) * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D
                                    + cols[None, :], mask=active[:, None] & (cols >= 0)[None, :], other=0.0,
                                    cache_modifier=".cg")
    return acc / tl.where(l == 0.0, 1.0, l)[:, None]


@triton.jit
def _decode_attn_kernel(
    q_ptr, k_ptr, v_ptr, last_ptr, sink_ptr, out_ptr, part_o_ptr, part_ml_ptr, counter_ptr,
    stride_lb, stride_lg, stride_qb, stride_qh, stride_qg,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_og,
    n_kv_heads, split_len,
    REP: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    SCALE_LOG2: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HAS_SINK: tl.constexpr,
    FP32_DOT: tl.constexpr, FUSED_MERGE: tl.constexpr,
):
    """One program per (sequence x key/value head, split): the ``REP * G`` query rows that read
    this head, over this split's filled slots, with an online softmax in base 2. With several
    splits and ``FUSED_MERGE``, the last program of a head to finish (counted in
    ``counter_ptr``, which it resets to 0) merges the splits' partial sums: one launch."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // n_kv_heads
    kvh = pid % n_kv_heads
    rows = tl.arange(0, BLOCK_M)  # row r: query head kvh * REP + r // G, row r % G of it
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < REP * G
    col_ok = cols < D
    head = kvh * REP + rows // G
    row_len = (tl.load(last_ptr + b * stride_lb + (rows % G) * stride_lg, mask=row_ok, other=-1) + 1).to(tl.int32)
    length = tl.max(row_len, 0)
    start = split * split_len
    end = tl.minimum(start + split_len, length)
    if start < length:
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + (rows % G)[:, None] * stride_qg
                    + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        k_base = k_ptr + b * stride_kb + kvh * stride_kh
        v_base = v_ptr + b * stride_vb + kvh * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            kt = tl.load(k_base + n[None, :] * stride_ks + cols[:, None], mask=n_ok[None, :] & col_ok[:, None],
                         other=0.0)  # [BLOCK_D, BLOCK_N]
            if FP32_DOT:
                s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(n_ok[None, :] & (n[None, :] < row_len[:, None]), s * SCALE_LOG2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no slot yet (shorter than its sequence's longest) keeps max -inf;
            # subtracting 0 instead keeps its weights 0 rather than NaN.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(s - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_base + n[:, None] * stride_vs + cols[None, :], mask=n_ok[:, None] & col_ok[None, :],
                         other=0.0)  # [BLOCK_N, BLOCK_D]
            if FP32_DOT:
                pv = tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(vt.dtype), vt)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if SPLITS == 1:
            if HAS_SINK:  # one more logit per head, its value zero: it only adds to the denominator
                s_sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
                m_new = tl.maximum(m_i, s_sink)
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.exp2(s_sink - m_new)
                acc = acc * alpha[:, None]
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # 0 only in padding rows, never stored
            tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + (rows % G)[:, None] * stride_og
                     + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        else:
            # Partial sums of this split: acc [BLOCK_M, BLOCK_D], then max and sum [2, BLOCK_M]. A
            # split past every row's length writes nothing (the merge reads only active splits).
            base = pid * SPLITS + split
            tl.store(part_o_ptr + base * BLOCK_M * BLOCK_D + rows[:, None] * BLOCK_D + cols[None, :], acc)
            tl.store(part_ml_ptr + base * 2 * BLOCK_M + rows, m_i)
            tl.store(part_ml_ptr + base * 2 * BLOCK_M + BLOCK_M + rows, l_i)
    if FUSED_MERGE:
        # Every program of the head counts itself in; the last one merges. The barrier puts all of
        # this program's partial stores before its release, the acquire puts the other programs'
        # before the merge's loads.
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            n_active = tl.cdiv(length, split_len)
            out = _merge_partials(part_o_ptr, part_ml_ptr, sink_ptr, pid, head, rows, cols, row_ok, n_active,
                                  BLOCK_M, BLOCK_D, SPLITS, HAS_SINK)
            tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + (rows % G)[:, None] * stride_og
                     + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
            tl.atomic_xchg(counter_ptr + pid, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _merge_splits_kernel(
    part_o_ptr, part_ml_ptr, last_ptr, sink_ptr, out_ptr,
    stride_lb, stride_lg, stride_ob, stride_oh, stride_og, n_kv_heads, split_len,
    REP: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr, HAS_SINK: tl.constexpr,
):
    """The merge as a second launch (no counters given): one program per (sequence x key/value
    head)."""
    pid = tl.program_id(0)
    b = pid // n_kv_heads
    kvh = pid % n_kv_heads
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < REP * G
    head = kvh * REP + rows // G
    row_len = (tl.load(last_ptr + b * stride_lb + (rows % G) * stride_lg, mask=row_ok, other=-1) + 1).to(tl.int32)
    n_active = tl.cdiv(tl.max(row_len, 0), split_len)
    out = _merge_partials(part_o_ptr, part_ml_ptr, sink_ptr, pid, head, rows, cols, row_ok, n_active,
                          BLOCK_M, BLOCK_D, SPLITS, HAS_SINK)
    tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + (rows % G)[:, None] * stride_og + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < D)[None, :])


# Launch shape. Read at each call (a compiled step reads them when it is traced);
# ``benchmarks/decode_attention_sweep.py`` times the alternatives on a GPU.
BLOCK_N = 64  # slots per iteration of a program's loop
NUM_WARPS = 4
NUM_STAGES: int | None = None  # software-pipelining depth of that loop (None: Triton's default)
TARGET_PROGRAMS = 128  # about one per SM of an H100/H200: enough splits to occupy the GPU
# Slots per split at least. Timed on an H200 (docs/benchmarks.md, tenth session): with the merge
# fused, splits of 64 to 128 slots beat 256 on every decode shape of 124m and 1b (a cache of 2049
# slots holding 1024: 6.9-7.0 us against 8.0 per call at batch 1).
MIN_SPLIT = 64


def default_splits(batch: int, kv_heads: int, slots: int) -> int:
    """Splits per head: enough programs to fill the GPU, none shorter than ``MIN_SPLIT`` slots
    of the static cache (shapes only, so one captured graph serves every length)."""
    return max(1, min(math.ceil(TARGET_PROGRAMS / (batch * kv_heads)), slots // MIN_SPLIT))


def split_counters(n: int, device) -> Tensor:
    """Zeroed counters for ``decode_attention(..., counters=)``: one per (sequence x key/value
    head) of the largest call; the kernel leaves them zero after every launch, so one buffer
    serves every layer of a step and every step."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, last: Tensor, sink: Tensor | None = None,
                     splits: int | None = None, counters: Tensor | None = None) -> Tensor:
    """``q`` [B, Hq, G, D] (G query rows per sequence) against the cache ``k``/``v``
    [B, Hkv, S, D] (last dimension contiguous), query row ``(b, g)`` seeing slots
    ``<= last[b, g]`` (``last`` [B, G], or [B] / [B, 1] for all rows of a sequence; integers in
    ``0..S-1``);
    ``sink`` [Hq] or None. Returns [B, Hq, G, D] in ``q``'s dtype. Equal to
    ``decode_attention_reference`` up to rounding.

    ``counters`` (``split_counters``, at least ``B * Hkv``; the KV cache holds one): the splits of
    a head are merged by the last of their programs to finish, in the same launch; without it a
    second small kernel merges them (a launch and about 3 us per layer on an H200)."""
    b, hq, g, d = q.shape
    kvh, slots = k.shape[1], k.shape[2]
    if hq % kvh or k.shape[0] != b or v.shape != k.shape or k.shape[3] != d:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit k {tuple(k.shape)} / v {tuple(v.shape)}")
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError("decode_attention: the head dimension must be contiguous")
    rep = hq // kvh
    block_n = BLOCK_N
    splits = splits or default_splits(b, kvh, slots)
    split_len = triton.cdiv(triton.cdiv(slots, splits), block_n) * block_n
    splits = triton.cdiv(slots, split_len)
    block_m = max(16, triton.next_power_of_2(rep * g))
    block_d = max(16, triton.next_power_of_2(d))
    out = torch.empty_like(q)
    if splits > 1:
        part_o = torch.empty(b * kvh * splits * block_m * block_d, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(b * kvh * splits * 2 * block_m, device=q.device, dtype=torch.float32)
    else:
        part_o = part_ml = out  # not written
    last = last.view(b, -1)  # [B, 1] (stride 0 over G below) or [B, G]; no copy, no cast
    if last.shape[1] not in (1, g):
        raise ValueError(f"decode_attention: last {tuple(last.shape)} for {g} rows per sequence")
    fused = splits > 1 and counters is not None
    if fused and (counters.dtype != torch.int32 or counters.numel() < b * kvh):
        raise ValueError(f"decode_attention: counters must be int32 with at least {b * kvh} entries")
    stride_lg = last.stride(1) if last.shape[1] > 1 else 0
    # Never read without sinks / fused merging. Not another argument: inductor realised a
    # separate copy of q (or of ``last``) for each argument it was passed as, one more kernel
    # per layer (profiled on the H200); an uninitialised scalar costs nothing.
    sink_arg = sink if sink is not None else torch.empty(1, device=q.device, dtype=torch.float32)
    counter_arg = counters if fused else torch.empty(1, device=q.device, dtype=torch.int32)
    common = dict(REP=rep, G=g, D=d, BLOCK_M=block_m, BLOCK_D=block_d, SPLITS=splits, HAS_SINK=sink is not None)
    launch = {"num_warps": NUM_WARPS} if NUM_STAGES is None else {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES}
    _decode_attn_kernel[(b * kvh, splits)](
        q, k, v, last, sink_arg, out, part_o, part_ml, counter_arg,
        last.stride(0), stride_lg, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        kvh, split_len,
        # fp32 inputs multiply in full fp32 ("ieee", not tf32). So do bf16 ones in Triton's CPU
        # interpreter, whose bf16 ``tl.dot`` is wrong (seen with Triton 3.x: a 16x16 product off
        # by 1e10); bf16 converts to fp32 exactly, so only the speed differs.
        SCALE_LOG2=d ** -0.5 * LOG2E, BLOCK_N=block_n, FP32_DOT=q.dtype == torch.float32 or interpreting(),
        FUSED_MERGE=fused, **launch, **common,
    )
    if splits > 1 and not fused:
        _merge_splits_kernel[(b * kvh,)](
            part_o, part_ml, last, sink_arg, out, last.stride(0), stride_lg,
            out.stride(0), out.stride(1), out.stride(2), kvh, split_len,
            num_warps=4, **common,
        )
    return out
