"""Fused Triton kernels for multi-head depth routing (MHAR; ``heads=1`` is AttnRes).

Routing is memory-bound: per position it reads ``N`` source rows of width ``d`` and does
``O(N*d)`` arithmetic. Eager PyTorch reads and writes the ``[N, M, d]`` stack many times
(casts, normalised keys, products, weighted values); these kernels read it the minimum number
of times instead.

Forward (``_route_fwd_kernel``): one program per block of ``BLOCK_M`` positions streams over
the sources once. For each source it computes the full-row RMS, the per-head logits
``(s . query*gain) / rms`` and folds the source into an online (streaming) softmax, as in flash
attention, so that no logit has to be known in advance. It writes ``out`` and the routing
weights ``alpha`` [N, M, H] (fp32). Saved for backward: ``alpha`` plus the inputs; norms and
logits are recomputed.

Backward (``_route_bwd_kernel``), with ``n_i = s_i / r_i`` and ``qg = query * gain``::

    dalpha_{i,h} = dout[h] . s_i[h]
    D_h          = sum_i alpha_{i,h} dalpha_{i,h}
    dlogit_{i,h} = alpha_{i,h} (dalpha_{i,h} - D_h)
    ds_i[j]      = alpha_{i,h} dout[j]                                      (value path)
                 + (dlogit_{i,h} qg[j] - n_i[j] * c_i) / r_i                (key path, RMSNorm)
    c_i          = mean_j(dn_i[j] n_i[j]) = (1/d) sum_h dlogit_{i,h} logit_{i,h}
    P[j]         = sum_{positions, i} dlogit_{i,h(j)} n_i[j]
    dquery       = gain * P,   dgain = query * P

``D_h`` is needed before any ``ds_i`` can be written. Since ``out = sum_i alpha_i s_i``, it equals
``dout[h] . out[h]``, so the backward takes it from the forward's output and makes a single pass
over the sources (a first pass computing ``D`` from the sources would read them all twice). The
output is the next sublayer's input, which that sublayer keeps for its own backward, so saving it
costs no memory; with low-precision sources ``D`` then carries ``out``'s rounding, the same
rounding every consumer of the read sees. All arithmetic is fp32; ``ds`` is cast to the output's
dtype only when stored.

With ``ACCUMULATE`` the pass adds ``ds_i`` to what ``dsources`` holds (load, add in fp32,
store) instead of overwriting it. The model's buffered routing uses that to sum the gradients of
all the reads of a source in one buffer, in place, rather than writing a fresh ``[N, M, d]`` per
read for autograd to add up. One program owns each element within a launch and the reads'
backwards run one after another, so the sums stay deterministic.

``P`` is a reduction over all positions. Atomics would make it run-to-run nondeterministic, so
it is done in two fixed-order stages: a fixed number of persistent backward programs each write
their partial ``P`` to a ``[G, d]`` buffer, and ``_reduce_partials_kernel`` sums that buffer
over ``G`` in a fixed order. For a given shape and device the gradients are bitwise reproducible.

Layout: a row of width ``d`` is held as a ``[BLOCK_H, BLOCK_DH]`` tile (heads x columns within a
head, both padded to powers of two and masked), so per-head sums are plain reductions over the
last axis and any ``d = H * (d/H)`` works, power of two or not.

The kernels run on CUDA and, for tests, in Triton's CPU interpreter (``TRITON_INTERPRET=1``).
Triton reads that variable when ``@triton.jit`` decorates a function, and its own helpers
(``tl.sum``...) are decorated when ``triton`` is first imported, so it must be set before
``triton`` is imported at all (tests/kernels/conftest.py arranges that).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from archlab.kernels.routing_reference import validate_route_args, validate_tail


@triton.jit
def _source_base(src_ptr, tail_ptr, i, N, stride_n, HAS_TAIL: tl.constexpr):
    """Base pointer of source ``i``: row ``i`` of the ``[N, M, d]`` stack, or the tail (``i = N``).

    The tail shares the stack's stride over positions (the launcher ensures it), so one offset
    block serves both.
    """
    if HAS_TAIL:
        return tl.where(i < N, src_ptr + i * stride_n, tail_ptr)
    return src_ptr + i * stride_n


@triton.jit
def _route_fwd_kernel(
    src_ptr, tail_ptr, query_ptr, gain_ptr, out_ptr, w_ptr,
    N, M, D, H, DH,
    stride_sn, stride_sm, stride_om, stride_wn,
    eps,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DH: tl.constexpr, HAS_TAIL: tl.constexpr,
):
    """One program routes ``BLOCK_M`` positions over ``N`` stacked sources, then the tail if any.

    ``w_ptr`` receives alpha [N + HAS_TAIL, M, H] (fp32).
    """
    n_all = N + HAS_TAIL
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, BLOCK_DH)
    col = offs_h[:, None] * DH + offs_j[None, :]  # [BH, BDH] column within the row
    col_mask = (offs_h[:, None] < H) & (offs_j[None, :] < DH)
    m_mask = offs_m < M
    mask = m_mask[:, None, None] & col_mask[None, :, :]
    qg = (tl.load(query_ptr + col, mask=col_mask, other=0.0).to(tl.float32)
          * tl.load(gain_ptr + col, mask=col_mask, other=0.0).to(tl.float32))
    rows = offs_m.to(tl.int64)
    src_off = rows[:, None, None] * stride_sm + col[None, :, :]
    w_off = rows[:, None] * H + offs_h[None, :]  # [BM, BH] into one source's [M, H] slab
    w_mask = m_mask[:, None] & (offs_h[None, :] < H)

    run_max = tl.full((BLOCK_M, BLOCK_H), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_M, BLOCK_H), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_H, BLOCK_DH), tl.float32)
    w_i = w_ptr
    s_next = tl.load(src_ptr + src_off, mask=mask, other=0.0)
    for i in range(n_all):
        # Prefetch source i+1 while source i is processed (one load in flight per program is
        # too little to keep HBM busy). The last iteration re-reads the last source, a cache
        # hit, rather than branching or masking on i.
        s = s_next.to(tl.float32)
        nxt = tl.minimum(i + 1, n_all - 1).to(tl.int64)
        s_next = tl.load(_source_base(src_ptr, tail_ptr, nxt, N, stride_sn, HAS_TAIL) + src_off,
                         mask=mask, other=0.0)
        inv_rms = tl.rsqrt(tl.sum(tl.sum(s * s, axis=2), axis=1) / D + eps)  # [BM]
        logit = tl.sum(s * qg[None, :, :], axis=2) * inv_rms[:, None]  # [BM, BH]
        tl.store(w_i + w_off, logit, mask=w_mask)  # raw logits; normalised below
        new_max = tl.maximum(run_max, logit)
        scale = tl.exp(run_max - new_max)
        p = tl.exp(logit - new_max)
        run_sum = run_sum * scale + p
        acc = acc * scale[:, :, None] + p[:, :, None] * s
        run_max = new_max
        w_i += stride_wn

    out = acc / run_sum[:, :, None]
    out_off = rows[:, None, None] * stride_om + col[None, :, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=mask)

    # Turn this program's logits into weights. The barrier makes the stores above visible to
    # every thread of the program, whichever thread the loads below land on.
    tl.debug_barrier()
    lse = run_max + tl.log(run_sum)
    w_i = w_ptr
    for _ in range(n_all):
        logit = tl.load(w_i + w_off, mask=w_mask, other=0.0)
        tl.store(w_i + w_off, tl.exp(logit - lse), mask=w_mask)
        w_i += stride_wn


@triton.jit
def _source_terms(s, qg, dout, delta, alpha, D, eps):
    """One source's backward terms at a block of positions, all fp32: ``(inv_rms, normed, dlogit,
    c)``, with ``dlogit`` [BM, BH] and ``c`` [BM] as in the module docstring. ``delta`` and
    ``dout`` are the reader's; the source's gradient from this reader is then
    ``alpha * dout + inv_rms * (dlogit * qg - normed * c)``."""
    inv_rms = tl.rsqrt(tl.sum(tl.sum(s * s, axis=2), axis=1) / D + eps)
    normed = s * inv_rms[:, None, None]
    logit = tl.sum(normed * qg[None, :, :], axis=2)
    dlogit = alpha * (tl.sum(dout * s, axis=2) - delta)  # [BM, BH]
    c = tl.sum(dlogit * logit, axis=1) / D  # [BM]
    return inv_rms, normed, dlogit, c


@triton.jit
def _route_bwd_kernel(
    src_ptr, tail_ptr, query_ptr, gain_ptr, out_ptr, dout_ptr, w_ptr, dsrc_ptr, dtail_ptr, part_ptr,
    keep_dout_ptr, keep_alpha_ptr, keep_dlogit_ptr, keep_c_ptr,
    N, M, D, H, DH, BLOCKS_PER_PROG,
    stride_sn, stride_sm, stride_om, stride_dom, stride_dsn, stride_dsm, stride_wn,
    stride_kdm, stride_kan, stride_kcn,
    eps,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DH: tl.constexpr, ACCUMULATE: tl.constexpr,
    HAS_TAIL: tl.constexpr, DEFER: tl.constexpr,
):
    """Persistent program: ``BLOCKS_PER_PROG`` consecutive position blocks, one pass each.

    Writes ``dsources`` (``ACCUMULATE``: adds to it), the tail's gradient (overwritten, never
    accumulated) and this program's partial ``P`` (row ``pid`` of ``part_ptr`` [G, d]).

    ``DEFER`` (the deferred backward, see ``DeferredGrads``): no source gradient is written but
    the tail's. Instead the program keeps what the source gradients need from this reader:
    ``dout`` (to ``keep_dout_ptr`` [M, d]), and per source ``alpha``, ``dlogit`` ([N, M, H] fp32
    at ``keep_alpha_ptr`` / ``keep_dlogit_ptr``) and ``c`` ([N, M] fp32 at ``keep_c_ptr``).
    """
    n_all = N + HAS_TAIL
    pid = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, BLOCK_DH)
    col = offs_h[:, None] * DH + offs_j[None, :]
    col_mask = (offs_h[:, None] < H) & (offs_j[None, :] < DH)
    qg = (tl.load(query_ptr + col, mask=col_mask, other=0.0).to(tl.float32)
          * tl.load(gain_ptr + col, mask=col_mask, other=0.0).to(tl.float32))
    p_acc = tl.zeros((BLOCK_M, BLOCK_H, BLOCK_DH), tl.float32)

    for blk in range(BLOCKS_PER_PROG):
        offs_m = (pid * BLOCKS_PER_PROG + blk) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        mask = m_mask[:, None, None] & col_mask[None, :, :]
        rows = offs_m.to(tl.int64)
        src_off = rows[:, None, None] * stride_sm + col[None, :, :]
        dsrc_off = rows[:, None, None] * stride_dsm + col[None, :, :]
        w_off = rows[:, None] * H + offs_h[None, :]
        w_mask = m_mask[:, None] & (offs_h[None, :] < H)
        dout = tl.load(dout_ptr + rows[:, None, None] * stride_dom + col[None, :, :],
                       mask=mask, other=0.0).to(tl.float32)

        # D_h = sum_i alpha_{i,h} (dout[h] . s_i[h]) = dout[h] . out[h], since out = sum_i alpha_i s_i.
        out = tl.load(out_ptr + rows[:, None, None] * stride_om + col[None, :, :],
                      mask=mask, other=0.0).to(tl.float32)
        delta = tl.sum(dout * out, axis=2)
        if DEFER:
            tl.store(keep_dout_ptr + rows[:, None, None] * stride_kdm + col[None, :, :],
                     dout.to(keep_dout_ptr.dtype.element_ty), mask=mask)

        # One pass over the sources: recompute the norms, write ds_i, accumulate P.
        s_next = tl.load(src_ptr + src_off, mask=mask, other=0.0)
        alpha_next = tl.load(w_ptr + w_off, mask=w_mask, other=0.0)
        for i in range(n_all):
            s = s_next.to(tl.float32)
            alpha = alpha_next
            nxt = tl.minimum(i + 1, n_all - 1).to(tl.int64)
            s_next = tl.load(_source_base(src_ptr, tail_ptr, nxt, N, stride_sn, HAS_TAIL) + src_off,
                             mask=mask, other=0.0)
            alpha_next = tl.load(w_ptr + nxt * stride_wn + w_off, mask=w_mask, other=0.0)
            cur = tl.cast(i, tl.int64)
            ds_ptrs = _source_base(dsrc_ptr, dtail_ptr, cur, N, stride_dsn, HAS_TAIL) + dsrc_off
            if ACCUMULATE:  # issued here so that the arithmetic below hides its latency
                old_mask = mask
                if HAS_TAIL:  # the tail's gradient starts from zero: a masked load reads nothing
                    # (a row bound of 0 rather than ``m_mask & (cur < N)``: Triton's interpreter
                    # turns a block-and-scalar ``&`` of booleans into int32, which loads reject)
                    rows_old = offs_m < tl.where(cur < N, M, 0)
                    old_mask = rows_old[:, None, None] & col_mask[None, :, :]
                ds_old = tl.load(ds_ptrs, mask=old_mask, other=0.0).to(tl.float32)
            inv_rms, normed, dlogit, c = _source_terms(s, qg, dout, delta, alpha, D, eps)
            p_acc += dlogit[:, :, None] * normed
            if DEFER:  # a stacked source's terms are kept; only the tail's gradient is written
                rows_kept = offs_m < tl.where(cur < N, M, 0)
                kept = rows_kept[:, None] & (offs_h[None, :] < H)
                tl.store(keep_alpha_ptr + cur * stride_kan + w_off, alpha, mask=kept)
                tl.store(keep_dlogit_ptr + cur * stride_kan + w_off, dlogit, mask=kept)
                tl.store(keep_c_ptr + cur * stride_kcn + rows, c, mask=rows_kept)
                rows_tail = offs_m < tl.where(cur < N, 0, M)
                ds_mask = rows_tail[:, None, None] & col_mask[None, :, :]
            else:
                ds_mask = mask
            ds = (alpha[:, :, None] * dout
                  + inv_rms[:, None, None] * (dlogit[:, :, None] * qg[None, :, :]
                                              - normed * c[:, None, None]))
            if ACCUMULATE:
                ds += ds_old
            tl.store(ds_ptrs, ds.to(dsrc_ptr.dtype.element_ty), mask=ds_mask)

    tl.store(part_ptr + pid.to(tl.int64) * D + col, tl.sum(p_acc, axis=0), mask=col_mask)


@triton.jit
def _reduce_partials_kernel(
    part_ptr, query_ptr, gain_ptr, dquery_ptr, dgain_ptr, G, D,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Stage 2: ``P = sum_g part[g]`` in a fixed order; ``dquery = gain*P``, ``dgain = query*P``."""
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for g0 in range(0, G, BLOCK_G):
        offs_g = g0 + tl.arange(0, BLOCK_G)
        ptrs = part_ptr + offs_g.to(tl.int64)[:, None] * D + offs_d[None, :]
        acc += tl.load(ptrs, mask=(offs_g[:, None] < G) & d_mask[None, :], other=0.0)
    total = tl.sum(acc, axis=0)
    query = tl.load(query_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    gain = tl.load(gain_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    tl.store(dquery_ptr + offs_d, gain * total, mask=d_mask)
    tl.store(dgain_ptr + offs_d, query * total, mask=d_mask)


@triton.jit
def _assemble_grad_kernel(
    src_ptr, dout_ptr, alpha_ptr, dlogit_ptr, c_ptr, qg_ptr, ds_ptr,
    n_readers, M, D, H, DH,
    stride_sm, stride_dr, stride_dm, stride_ar, stride_cr, stride_dsm,
    eps,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DH: tl.constexpr,
):
    """One source's gradient over all its readers, written once (the deferred backward).

    ``ds = sum_r alpha_r dout_r + inv_rms * (sum_r dlogit_r qg_r - normed * sum_r c_r)``, with
    ``r`` over the first ``n_readers`` rows of the kept stacks: ``dout`` [R, M, d], ``alpha`` and
    ``dlogit`` [R, M, H] and ``c`` [R, M] (this source's slice), ``qg`` [R, d] fp32. The source's
    norm is recomputed from ``src_ptr`` [M, d], read once.
    """
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, BLOCK_DH)
    col = offs_h[:, None] * DH + offs_j[None, :]
    col_mask = (offs_h[:, None] < H) & (offs_j[None, :] < DH)
    m_mask = offs_m < M
    mask = m_mask[:, None, None] & col_mask[None, :, :]
    rows = offs_m.to(tl.int64)
    w_off = rows[:, None] * H + offs_h[None, :]
    w_mask = m_mask[:, None] & (offs_h[None, :] < H)
    d_off = rows[:, None, None] * stride_dm + col[None, :, :]

    s = tl.load(src_ptr + rows[:, None, None] * stride_sm + col[None, :, :], mask=mask,
                other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(tl.sum(s * s, axis=2), axis=1) / D + eps)
    value = tl.zeros((BLOCK_M, BLOCK_H, BLOCK_DH), tl.float32)  # sum_r alpha_r dout_r
    key = tl.zeros((BLOCK_M, BLOCK_H, BLOCK_DH), tl.float32)  # sum_r dlogit_r qg_r
    c_sum = tl.zeros((BLOCK_M,), tl.float32)
    dout_next = tl.load(dout_ptr + d_off, mask=mask, other=0.0)
    for k in range(n_readers):
        r = tl.cast(k, tl.int64)
        dout = dout_next.to(tl.float32)
        # prefetch the next reader's rows (the last iteration re-reads its own: a cache hit)
        r_next = tl.minimum(k + 1, n_readers - 1).to(tl.int64)
        dout_next = tl.load(dout_ptr + r_next * stride_dr + d_off, mask=mask, other=0.0)
        alpha = tl.load(alpha_ptr + r * stride_ar + w_off, mask=w_mask, other=0.0)
        dlogit = tl.load(dlogit_ptr + r * stride_ar + w_off, mask=w_mask, other=0.0)
        c_sum += tl.load(c_ptr + r * stride_cr + rows, mask=m_mask, other=0.0)
        qg = tl.load(qg_ptr + r * D + col, mask=col_mask, other=0.0)
        value += alpha[:, :, None] * dout
        key += dlogit[:, :, None] * qg[None, :, :]
    ds = value + inv_rms[:, None, None] * (key - s * (inv_rms * c_sum)[:, None, None])
    tl.store(ds_ptr + rows[:, None, None] * stride_dsm + col[None, :, :],
             ds.to(ds_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class _Tiles:
    """Tile shape for one routing call; see ``_tiles`` for how it is chosen."""

    block_m: int
    block_h: int
    block_dh: int
    num_warps: int  # backward
    fwd_warps: int


def _tiles(m: int, d: int, heads: int, device: torch.device, accumulate: bool = False) -> _Tiles:
    """Pick the tile: full padded rows, ``BLOCK_M`` rows per program, few warps.

    Measured on an H200 (d = 768..2048, bf16 and fp32): small programs (one row of about 1K
    padded columns, two warps, so 16-32 elements per thread) beat larger ones in both passes,
    because many resident programs keep more loads in flight than a few wide ones whose
    cross-warp reductions stall every step. Narrow rows are packed up to about 1K elements. In
    the CPU interpreter every program runs in turn in Python, so fewer, larger programs are
    faster there.

    Single-head forward: one warp per row of up to 1K padded columns. Its two row reductions per
    source (the RMS and the one logit) then stay inside a warp, with no barrier: at 32k positions
    in bf16 that took the forward from 0.567 to 0.439 ms (d = 768, N = 25) and from 1.185 to
    0.965 ms (d = 1024, N = 49) on an H200, while one warp made the backward slower and the
    4-head forward slower too (``benchmarks/attnres_kernels.py --tiles``, docs/benchmarks.md).

    Multi-head backward that accumulates (``accumulate``, as the model's buffered routing runs
    it): two rows of about 1K padded columns and four warps. Measured, not explained (it was not
    profiled): with that tile a 4-head forward + accumulating backward took about 8% less time
    (d = 768 and 1024, N = 13 and 25, bf16, 32k positions, H200), while for one head, and
    without accumulation, the default tile stayed best (``attnres_kernels.py --accumulate
    --tiles``).
    """
    block_h = triton.next_power_of_2(heads)
    block_dh = triton.next_power_of_2(d // heads)
    block_d = block_h * block_dh
    if device.type == "cuda":
        block_m = max(1, 1024 // block_d)
        num_warps = 2 if block_m * block_d <= 2048 else 4
        fwd_warps = 1 if heads == 1 and block_m * block_d <= 1024 else num_warps
        if accumulate and heads > 1:
            block_m, num_warps = 2 * block_m, 4
    else:
        block_m = min(8, triton.next_power_of_2(max(m, 1)))
        num_warps = fwd_warps = 1
    return _Tiles(block_m, block_h, block_dh, num_warps, fwd_warps)


def _backward_programs(n_blocks: int, device: torch.device) -> int:
    """Number ``G`` of persistent backward programs (rows of the partial-sum buffer).

    Enough to fill the GPU a few times over, but far fewer than the position blocks, so that the
    ``[G, d]`` partial buffer and its reduction stay small next to the sources.
    """
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_blocks, 8 * sms))
    return max(1, min(n_blocks, 4))  # at least one: it writes the (zero) partial sum


def _device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Make ``t``'s GPU current: Triton launches on the current device, not the tensors'."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check_tail(sources: torch.Tensor, tail: torch.Tensor | None) -> None:
    """The kernels address the tail with the stack's offsets: same shape, dtype and row stride."""
    validate_tail(sources, tail)
    if tail is not None and tail.stride() != sources.stride()[1:]:
        raise ValueError("tail must have the sources' strides over (M, d)")


def _route_forward(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor, heads: int,
                   eps: float, tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; returns ``out`` [M, d] (source dtype) and ``alpha`` [N', M, H].

    ``tail`` [M, d] is one more source after the ``N`` of ``sources`` (``N' = N + 1``), read in
    place: the model's Block AttnRes passes a block's partial sum this way instead of copying it
    into its source buffer.
    """
    _check_tail(sources, tail)
    n, m, d = sources.shape
    n_all = n + (tail is not None)
    t = _tiles(m, d, heads, sources.device)
    out = torch.empty((m, d), dtype=sources.dtype, device=sources.device)
    weights = torch.empty((n_all, m, heads), dtype=torch.float32, device=sources.device)
    if m == 0:  # no positions, nothing to launch
        return out, weights
    with _device_guard(sources):
        _route_fwd_kernel[(triton.cdiv(m, t.block_m),)](
            sources, sources if tail is None else tail, query, gain, out, weights,
            n, m, d, heads, d // heads,
            sources.stride(0), sources.stride(1), out.stride(0), weights.stride(0),
            eps,
            BLOCK_M=t.block_m, BLOCK_H=t.block_h, BLOCK_DH=t.block_dh, HAS_TAIL=tail is not None,
            num_warps=t.fwd_warps,
        )
    return out, weights


class DeferredGrads:
    """What the deferred backward keeps of each read (reader) of a row group's source stack, until
    each source's gradient is assembled once from all its readers.

    A read's backward over ``N`` sources must give each source ``alpha dout + (dlogit qg - n c) /
    rms``. The accumulating backward adds that to a gradient buffer at once: per (read, source)
    pair it reads the source, reads the sum so far and writes it back, three rows. The deferred
    one keeps the read's ``dout`` row and, per pair, the per-head scalars ``alpha`` and ``dlogit``
    and the per-position ``c``; when every reader of a source has run (the backward of the read
    that wrote the source, with the model's token chain), ``assemble`` reads the source once and
    each reader's kept ``dout`` once and writes the gradient once. Per pair that is two rows
    (the source in the reader's pass, the reader's ``dout`` in the assembly) instead of three,
    and the gradient buffer is not needed. Memory: ``dout`` [R, M, d] in ``dtype`` plus
    ``(2H + 1) * 4`` bytes per (reader, source, position).

    Readers are numbered in forward order; a source ``i`` written by reader ``w`` is read by every
    reader from ``w`` to the last one of the forward (a stack only grows), so the readers of a
    source are a range and the kernels take its bounds, with no index list to copy to the device.
    A reader whose backward got no gradient (``skip``) keeps zeros.
    """

    def __init__(self, n_readers: int, n_sources: int, m: int, d: int, heads: int, dtype: torch.dtype,
                 device: torch.device):
        f32 = torch.float32
        self.dout = torch.empty(n_readers, m, d, dtype=dtype, device=device)
        self.alpha = torch.empty(n_readers, n_sources, m, heads, dtype=f32, device=device)
        self.dlogit = torch.empty(n_readers, n_sources, m, heads, dtype=f32, device=device)
        self.c = torch.empty(n_readers, n_sources, m, dtype=f32, device=device)
        self.qg = torch.empty(n_readers, d, dtype=f32, device=device)
        self.heads = heads
        #: the highest reader whose backward ran (the first to run: backwards go in reverse order)
        self.last: int | None = None
        self._latest: int | None = None  # the reader whose backward ran most recently

    def _ran(self, reader: int) -> None:
        if self._latest is not None and reader >= self._latest:
            raise RuntimeError(f"deferred routing backward: reader {reader} ran after reader {self._latest}; "
                               "the readers' backwards must run in reverse forward order")
        if self.last is None:
            self.last = reader
        self._latest = reader

    def skip(self, reader: int) -> None:
        """Reader ``reader``'s backward got no gradient: it adds nothing to its sources."""
        self._ran(reader)
        for t in (self.dout, self.alpha, self.dlogit, self.c):
            t[reader].zero_()

    def assemble(self, source: torch.Tensor, slot: int, first_reader: int, eps: float,
                 dtype: torch.dtype) -> torch.Tensor | None:
        """The gradient [M, d] (``dtype``) of ``source`` (slot ``slot`` of the stack, read first by
        reader ``first_reader``) from every reader from there to ``last``; None if none ran."""
        if self.last is None or self.last < first_reader:
            return None
        m, d = source.shape
        n_readers = self.last - first_reader + 1
        ds = torch.empty((m, d), dtype=dtype, device=source.device)
        if m == 0:
            return ds
        if source.stride(-1) != 1:
            source = source.contiguous()
        t = _tiles(m, d, self.heads, source.device)
        heads = self.heads
        r0 = first_reader
        with _device_guard(source):
            _assemble_grad_kernel[(triton.cdiv(m, t.block_m),)](
                source, self.dout[r0:], self.alpha[r0:, slot], self.dlogit[r0:, slot], self.c[r0:, slot],
                self.qg[r0:], ds,
                n_readers, m, d, heads, d // heads,
                source.stride(0), self.dout.stride(0), self.dout.stride(1), self.alpha.stride(0),
                self.c.stride(0), ds.stride(0),
                eps,
                BLOCK_M=t.block_m, BLOCK_H=t.block_h, BLOCK_DH=t.block_dh, num_warps=t.num_warps,
            )
        return ds


def route_backward(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor,
                    weights: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, heads: int,
                    eps: float, accumulate_into: torch.Tensor | None = None,
                    tail: torch.Tensor | None = None, defer: DeferredGrads | None = None,
                    reader: int = 0,
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Launch both backward stages; returns ``(dsources, dtail, dquery, dgain)``.

    ``weights`` and ``out`` are what ``_route_forward`` returned (alpha contiguous [N', M, H]
    fp32; ``out`` [M, d]); ``out`` and ``dout`` [M, d] need unit stride over ``d``. With
    ``accumulate_into`` (an [N, M, d] tensor of any float dtype, unit stride over ``d``) the
    source gradients are added to it in place (summed in fp32, rounded once) and it is returned
    as ``dsources``; without, a fresh tensor of the sources' dtype is written. ``dtail`` (None
    without a tail) is always fresh, in the tail's dtype. Besides ``_RouteFunction``, the model's
    buffered routing (``archlab.model.attnres``) calls this directly, so keep the signature
    stable.

    With ``defer`` (and not ``accumulate_into``) no source gradient is written (``dsources`` is
    None): this read's terms are kept in ``defer`` as reader ``reader``, for
    ``DeferredGrads.assemble``. The tail's gradient is still returned fresh: a tail has one reader.
    """
    _check_tail(sources, tail)
    n, m, d = sources.shape
    if defer is not None and accumulate_into is not None:
        raise ValueError("route_backward: defer and accumulate_into exclude each other")
    t = _tiles(m, d, heads, sources.device, accumulate_into is not None or defer is not None)
    n_blocks = triton.cdiv(m, t.block_m)
    programs = _backward_programs(n_blocks, sources.device)
    if defer is not None:
        defer._ran(reader)
        defer.qg[reader].copy_(query.float() * gain.float())
        dsources = None
        keep = (defer.dout[reader], defer.alpha[reader], defer.dlogit[reader], defer.c[reader])
        like = keep[0]  # the one gradient written is the tail's: laid out like a kept dout
    else:
        if accumulate_into is None:
            dsources = torch.empty_like(sources, memory_format=torch.contiguous_format)
        else:
            if accumulate_into.shape != sources.shape or accumulate_into.stride(-1) != 1:
                raise ValueError(f"accumulate_into must be {tuple(sources.shape)} with unit stride over d")
            dsources = accumulate_into
        keep = (dsources, weights, weights, weights)  # not used without DEFER: any valid pointers
        like = dsources
    dtail = None
    if tail is not None:  # written with the stack's offsets, so laid out like one of its rows
        dtail = torch.empty_strided((m, d), like.stride()[-2:], dtype=like.dtype, device=sources.device)
    # The kernel's source-gradient stack. Deferred, only the tail's gradient is stored: the stack
    # is then the tail's row (any valid row without a tail) with a source stride of 0, which keeps
    # the masked-off addresses of every other source in bounds.
    ds_stack = dsources if defer is None else (keep[0] if dtail is None else dtail)
    ds_stride_n = 0 if defer is not None else dsources.stride(0)
    partials = torch.empty((programs, d), dtype=torch.float32, device=sources.device)
    dquery = torch.empty(d, dtype=torch.float32, device=sources.device)
    dgain = torch.empty(d, dtype=torch.float32, device=sources.device)
    block_d = min(128, triton.next_power_of_2(d))
    with _device_guard(sources):
        _route_bwd_kernel[(programs,)](
            sources, sources if tail is None else tail, query, gain, out, dout, weights, ds_stack,
            ds_stack if dtail is None else dtail, partials, *keep,
            n, m, d, heads, d // heads, triton.cdiv(n_blocks, programs),
            sources.stride(0), sources.stride(1), out.stride(0), dout.stride(0), ds_stride_n,
            ds_stack.stride(-2), weights.stride(0),
            keep[0].stride(-2), keep[1].stride(0), keep[3].stride(0),
            eps,
            BLOCK_M=t.block_m, BLOCK_H=t.block_h, BLOCK_DH=t.block_dh,
            ACCUMULATE=accumulate_into is not None, HAS_TAIL=tail is not None, DEFER=defer is not None,
            num_warps=t.num_warps,
        )
        _reduce_partials_kernel[(triton.cdiv(d, block_d),)](
            partials, query, gain, dquery, dgain, programs, d, BLOCK_G=32, BLOCK_D=block_d,
        )
    if dtail is not None:
        dtail = dtail.to(tail.dtype)
    return dsources, dtail, dquery.to(query.dtype), dgain.to(gain.dtype)


class _RouteFunction(torch.autograd.Function):
    """Autograd wrapper: saves the inputs, alpha and the output; the backward recomputes the norms."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, sources: torch.Tensor,
                tail: torch.Tensor | None, query: torch.Tensor, gain: torch.Tensor, heads: int,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, weights = _route_forward(sources, query, gain, heads, eps, tail)
        ctx.save_for_backward(sources, tail, query, gain, weights, out)
        ctx.heads = heads
        ctx.eps = eps
        ctx.mark_non_differentiable(weights)
        return out, weights

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor,
                 _dweights: torch.Tensor | None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, None, None]:
        sources, tail, query, gain, weights, out = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dsources, dtail, dquery, dgain = route_backward(sources, query, gain, weights, out, dout,
                                                         ctx.heads, ctx.eps, tail=tail)
        return dsources, dtail, dquery, dgain, None, None


def route_triton(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor, heads: int,
                 eps: float, return_weights: bool = False, tail: torch.Tensor | None = None,
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``route_reference``, computed by the fused kernels.

    ``sources`` may be strided over N and M (``buf[:n]`` of a preallocated ``[N_max, M, d]``
    buffer is used in place, no copy); only a non-unit stride over ``d`` forces a copy. ``tail``
    [M, d] is an extra last source read in place (see ``route``); when its strides differ from
    the sources' over (M, d), the sources are made contiguous and so is the tail. The returned
    weights are detached (they are diagnostics; no gradient flows through them).
    """
    validate_route_args(sources, query, gain, heads)  # the tail: by ``_check_tail`` in the launch
    if sources.stride(-1) != 1:
        sources = sources.contiguous()
    if tail is not None and tail.stride() != sources.stride()[1:]:
        sources, tail = sources.contiguous(), tail.contiguous()
    out, weights = _RouteFunction.apply(sources, tail, query.contiguous(), gain.contiguous(), heads,
                                        float(eps))
    if return_weights:
        return out, weights
    return out
