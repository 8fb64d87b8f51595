"""Attention residuals over depth: AttnRes, Block AttnRes, MHAR and delta conversion (spec section 2).

Two kinds of the ``residual`` slot (``model.residual.kind``; the interface is in
``archlab.model.core.residual``), with their options in ``model.residual.*``. ``L`` below is the
number of *visits* of the layer schedule (``n_layers`` for the sequential one): sites, sources and
routing queries are per visit, so a looped layer's later run routes over its earlier run's output.

``attnres``
    Sources ``s_0`` = the token embedding and ``s_i`` = the raw output of sublayer ``i - 1``.
    Sublayer ``l`` (site ``l`` in 0..2L-1) reads ``h_l = MHRoute_l(s_0 .. s_l)``, i.e. the embedding
    and the outputs of every sublayer before it; the model output reads one more routing site
    (index ``2L``) over all ``2L + 1`` sources, before the final norm.
    *Block AttnRes* (``residual.blocks = N``, ``0 < N < 2L``): the ``2L`` sublayers are split into
    ``N`` contiguous blocks and a read routes over ``b_0`` (the embedding), the completed block
    sums ``b_1 .. b_j`` and the current block's partial sum when it is non-empty. ``N = 0`` or
    ``N = 2L`` is full AttnRes (one block per sublayer, so the sources are exactly ``s_0 .. s_l``).

``delta``
    The identity-preserving conversion of a standard-residual model. The standard stream ``p``
    is kept (``p <- p + out``) and sublayer ``l`` reads ``p + g_l * MHRoute_l(sources)`` where the
    sources are a learnable null source (zero-initialised, ``[d]``) and one *delta* per group of
    sublayers (``residual.delta_groups = G``, 0 means one group per transformer layer, ``G = L``).
    A group delta is the **sum of that group's sublayer outputs**; the current group's partial sum
    (the outputs of the group's sublayers before ``l``) is a source when it is non-empty, exactly
    as Block AttnRes treats its current block. The final read has its own gate ``g_{2L}``.
    All gates start at 0.0, and ``p + 0.0 * r`` is bitwise ``p`` for finite ``r`` (the routed
    value is a convex mix of finite sources; RMSNorm's ``eps`` keeps the zero null source finite),
    so a converted model computes the original function exactly at step 0.

**Block split rule.** ``N`` blocks over ``S = 2L`` sublayers: block ``j`` holds the sites
``floor(j*S/N) .. floor((j+1)*S/N) - 1``. When ``N`` divides ``S`` every block has ``S/N``
sublayers; otherwise the sizes differ by at most one. Delta groups use the same rule.

**Routing** (``archlab.kernels.routing.route``): per site a pseudo-query ``w`` (zeros) and an
RMSNorm gain (ones), both ``[d]`` and 1-D (so weight-decay rules that skip vectors skip them).
The norm is over the full width, then the query and normalised keys are cut into ``H =
residual.heads`` slices: ``alpha^h_i = softmax_i(w[h] . RMSNorm(s_i)[h])`` and
``h[h] = sum_i alpha^h_i s_i[h]``. ``H = 1`` is AttnRes. Zero queries give a plain average.

**State and buffers.** Each run over the layers (the primary rows; the decode branch's follower
rows in training and prefill; primary and followers stacked in grouped decode) gets its own
``DepthState`` from ``start``; the module and its weights are shared. Routing is per position,
over depth only, so cached decoding (``T = 1``) and branch-only steps need no extra cache.
Two ways to hold the sources, chosen by ``residual.impl`` (resolved for the device):

* ``reference``: the sources are a Python list and each read ``torch.stack``s them. Plain
  autograd through ``route``; the readable ground truth. Stacking costs ``O(n)`` copies per read,
  and the eager reference saves its fp32 intermediates per read for backward.
* ``compile`` / ``triton``: one preallocated ``[n_max, M, d]`` buffer per row group and forward
  (``SourceBuffer``); each completed source (the embedding, a block sum) is copied in once, by
  the read that first routes over it, and its slot is never overwritten. A block's partial sum is
  read by one read only, so it never enters the buffer: the read routes over ``buf[:n]`` plus
  the partial sum as a *tail* source (``route(..., tail=)``), which the Triton kernels read in
  place and whose gradient they write fresh (``compile`` and ``reference`` copy it into the
  block's own slot, still free, and route over one more slot). A read is ``_BufferedRoute``, a
  custom ``autograd.Function`` that saves only the query, gain, routing weights, its output and
  its tail. Memory: one ``O(L*d)``-per-token buffer instead of ``O(L^2*d)``.

  Backward accumulates in place, as the MHAR paper does: every read adds its source gradients to
  one gradient buffer ``grad`` (shaped like ``buf``, zero-filled by the first backward), the
  Triton kernel with a load-add-store (``triton``) or an add of the recomputed route's gradients
  (``compile`` and, when forced, ``reference``). Letting autograd sum them instead costs an extra
  ``[M, d]`` tensor and add per (read, source) pair, ``O(L^2)`` of them. Each source is an input
  of the one read that wrote it, which hands it its slot of ``grad`` after adding its own share.
  That is complete only if every later read's backward has already run. Autograd's order follows
  data dependencies alone, so every read also takes a *token* (a 0-dim tensor, created with
  ``requires_grad``) and returns the next one: the chain makes the reads' backwards run in exact
  reverse forward order. The first read's backward (it wrote slot 0) frees both buffers, so a
  buffered forward supports one backward. Without grad there is no token and no gradient buffer.

  An earlier layout copied each partial sum into the block's free slot as scratch; per partial
  sum that cost a copy in, a copy back in backward, a read-modify-write of its gradient and a
  copy-and-zero to hand it out, which the tail avoids.

  Dtypes (``residual.source_dtype`` / ``residual.grad_dtype``, the stream's ``source_dtype`` /
  ``grad_dtype``): the sources are stored in the autocast dtype under autocast (bf16 on CUDA: the
  sublayer outputs are bf16 there anyway, and the routing moves half the bytes), else in the
  embedding's; the gradient buffer defaults to the sources' dtype. Reads come back in the model's
  dtype when no autocast would cast them.

  Inside a ``torch.compile``d model the buffered read is a graph break
  (``torch.compiler.disable``); the routing kernel itself still runs compiled or fused.

**FLOPs** (``cost``; forward, per token, per row): a routing read over ``n`` sources
counts ``7*n*d``: RMSNorm ``3*n*d`` (square-accumulate ``2nd``, scale ``nd``), logits ``2*n*d``
(multiply-accumulate against ``query*gain``), weighted sum ``2*n*d``. The ``O(n*H)`` softmax and the
``O(d)`` ``query*gain`` product are not counted (the accounting convention skips softmaxes).
Block/group partial sums add ``d`` per sublayer output added to a non-empty partial sum; delta
adds ``2*d`` per read for ``p + g*r``. The delta's own ``p <- p + out`` is the standard
residual's add, which the standard residual counts as 0, so it is not counted either.

**Across layer widths** (a ``width`` kind such as ><former's variable width): every source keeps
the full base width, zero beyond the width of the sublayer that wrote it, and a read at width
``w`` routes over every source's first ``w`` coordinates (the norm, the logits and the weighted
sum over those ``w``, with the first ``w`` entries of the site's query and gain). A narrower
layer so sees the wider sources truncated and a wider one the narrower sources zero-filled: the
routing analogue of truncate/refill, with no parameters. The delta stream ``p`` resizes as a
standard stream does. Widths that vary use the list path (the buffered kernels assume one width).

**Diagnostics.** ``with stream.recording() as rec:`` collects, per (row group, site), the routing
weights averaged over positions, per-position pairwise Jensen-Shannon divergences between heads
and, with ``sources=True``, the sources and read values themselves (tests). No model copy.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from archlab.kernels.routing import resolve_impl, route
from archlab.model.core.context import Context
from archlab.model.core.cost import Cost
from archlab.model.core.residual import resize_stream
from archlab.model.core.spec import base_width, n_visits
from archlab.model.variants.attnres.recording import RoutingRecorder, SiteRecord, mean_pairwise_js  # noqa: F401

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.init import Init
    from archlab.model.core.spec import LayerSpec


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # config names; "auto" -> None


# ---- block / group layout ---------------------------------------------------------------------
def block_bounds(n_sites: int, n_blocks: int) -> list[int]:
    """First site of each of ``n_blocks`` contiguous blocks over ``n_sites``, then ``n_sites``."""
    if not 1 <= n_blocks <= n_sites:
        raise ValueError(f"need 1 <= blocks <= {n_sites}, got {n_blocks}")
    return [(j * n_sites) // n_blocks for j in range(n_blocks + 1)]


# ``L`` in this module is the number of *visits* of the layer schedule (``len(layer_visits(cfg))``,
# which is ``n_layers`` for the sequential schedule): each visit has its two sites and its own
# routing queries, so a looped layer's second run routes over the first run's outputs as well.
def attnres_blocks(cfg: "ModelConfig") -> int:
    s = 2 * n_visits(cfg)
    return cfg.residual.blocks if 0 < cfg.residual.blocks < s else s


def delta_groups(cfg: "ModelConfig") -> int:
    return cfg.residual.delta_groups or n_visits(cfg)


def read_source_counts(cfg: "ModelConfig", n_blocks: int) -> list[int]:
    """Number of sources of each of the ``2L + 1`` reads (sites 0..2L-1, then the final read)."""
    s = 2 * n_visits(cfg)
    bounds = block_bounds(s, n_blocks)
    counts = []
    for j in range(n_blocks):
        for site in range(bounds[j], bounds[j + 1]):
            counts.append(1 + j + (site > bounds[j]))  # b_0, completed blocks, non-empty partial
    counts.append(1 + n_blocks)
    return counts


def site_label(site: int, n_visits: int) -> str:
    """``L{v}.attn`` / ``L{v}.mlp``: ``v`` is the visit (the layer, for the sequential schedule)."""
    if site == 2 * n_visits:
        return "final"
    return f"L{site // 2}.{'attn' if site % 2 == 0 else 'mlp'}"


# ---- state and the buffered routing op ----------------------------------------------------------
@dataclass
class DepthState:
    """The depth history of one row group in one forward."""

    shape: torch.Size  # the group's activation shape [..., d] at the start
    width: int  # the width reads return now (the layer's; the base width without a width kind)
    dtype: torch.dtype  # dtype of the sources as stored (the embedding's)
    device: torch.device
    rows: int  # M, positions of the group
    impl: str = "reference"  # the resolved routing implementation
    buffered: bool = False  # sources in a ``SourceBuffer`` (else the list ``done``)
    n_done: int = 0  # completed sources: b_0 (embedding / null), then completed blocks
    done: list[Tensor] = field(default_factory=list)  # list path: the completed sources [M, d]
    partial: Tensor | None = None  # current block's (group's) partial sum [M, d]
    #: buffered: (slot, source) that the next read writes into the buffer
    pending: list[tuple[int, Tensor]] = field(default_factory=list)
    store: SourceBuffer | None = None  # buffered: created by the first read
    #: buffered with autograd: the last read's token; the next read takes it (see ``_BufferedRoute``)
    token: Tensor | None = None
    p: Tensor | None = None  # delta: the standard stream
    stream: int = 0  # the run's row group (``ctx.rows.group``: 0 primary, 1 followers), for recording
    #: dtype reads are returned in when it differs from ``dtype`` (bf16 sources in an fp32 model
    #: without autocast); None: ``dtype``
    read_dtype: torch.dtype | None = None


class SourceBuffer:
    """One row group's completed sources ``buf`` [n_max, M, d] and, in backward, their gradients.

    Each slot is written once per forward. The reads' backward ops hold this object, not the
    ``DepthState``, so the graph keeps no source tensor, partial sum or token alive.
    """

    def __init__(self, n_max: int, rows: int, d: int, dtype: torch.dtype, device: torch.device,
                 grad_dtype: torch.dtype | None, deferred: bool = False):
        self.buf: Tensor | None = torch.empty(n_max, rows, d, dtype=dtype, device=device)
        self.grad: Tensor | None = None
        self.grad_dtype = grad_dtype or dtype
        #: the deferred backward (``residual.backward: deferred``, Triton only): each source's
        #: gradient assembled once from its readers' kept terms, instead of ``grad``
        self.deferred = deferred
        self.kept = None  # its ``DeferredGrads``, made by the first backward
        self.n_reads = 0  # reads made over this buffer with autograd: the next one's index

    def kept_terms(self, heads: int):
        """The ``DeferredGrads`` of this forward's reads (made by the first backward that needs it)."""
        if self.buf is None:
            raise RuntimeError("buffered depth routing supports one backward per forward (the source "
                               "buffer is freed when the first read's backward has run)")
        if self.kept is None:
            from archlab.kernels.routing_triton import DeferredGrads

            n_max, rows, d = self.buf.shape
            self.kept = DeferredGrads(self.n_reads, n_max, rows, d, heads, self.grad_dtype, self.buf.device)
        return self.kept

    def grad_slots(self, n: int) -> Tensor:
        """``grad[:n]``; the buffer is zero-filled by the first backward that needs it."""
        if self.buf is None:
            raise RuntimeError("buffered depth routing supports one backward per forward (the source "
                               "buffer is freed when the first read's backward has run)")
        if self.grad is None:
            self.grad = torch.zeros(self.buf.shape, dtype=self.grad_dtype, device=self.buf.device)
        return self.grad[:n]

    def take_grad(self, slot: int, dtype: torch.dtype) -> Tensor | None:
        """The gradient accumulated in ``slot``, in ``dtype`` (no copy when it already is)."""
        if self.grad is None:  # no read's gradient reached this buffer
            return None
        return self.grad[slot].to(dtype)


@functools.cache  # called by every read's backward; the import is looked up once
def _triton_backward():
    try:
        from archlab.kernels.routing_triton import route_backward
    except ImportError:  # pragma: no cover - triton missing
        return None
    return route_backward


def _tail_into_slot(store: SourceBuffer, n: int, tail: Tensor | None) -> int:
    """Copy ``tail`` into slot ``n`` and return the number of slots to route over.

    For the implementations without a tail operand, which would otherwise concatenate (a copy of
    every source per read). Slot ``n`` is free: the block the tail belongs to is not complete, and
    the block's sum lands there only when it is (in backward, a later block sum may have taken it
    since, so the copy is repeated there).
    """
    if tail is None:
        return n
    store.buf[n].copy_(tail)
    return n + 1


def _route_slots(store: SourceBuffer, n: int, query: Tensor, gain: Tensor, heads: int, eps: float,
                 impl: str, tail: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(out, weights)`` of the route over ``store.buf[:n]`` plus ``tail`` (read in place by the
    Triton kernels, through slot ``n`` otherwise)."""
    if impl != "triton":
        n, tail = _tail_into_slot(store, n, tail), None
    return route(store.buf[:n], query, gain, heads, eps, impl, return_weights=True, tail=tail)


class _BufferedRoute(torch.autograd.Function):
    """Write the pending sources into their slots, then route over ``store.buf[:n]`` and ``tail``.

    Differentiable inputs: ``query``, ``gain``, the token, the tail (the current block's partial
    sum, or None) and the sources ``written`` here; each source is an input of exactly the read
    that writes it, so autograd delivers its gradient once and sums nothing. The other reads'
    gradients for it reach it through ``store.grad``: the token chain runs the backwards in exact
    reverse order of the forwards, so when this read's backward runs, every later read has added
    its share to the slots, and the gradient of the sources written here is complete once this
    read has added its own. A partial sum is read by one read only: it is routed in place as the
    tail and its gradient comes back fresh, never through the buffer.
    """

    @staticmethod
    def forward(ctx, store: SourceBuffer, n: int, slots: tuple[int, ...], heads: int, eps: float,
                impl: str, query: Tensor, gain: Tensor, token: Tensor, tail: Tensor | None,
                *written: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        for slot, src in zip(slots, written):
            store.buf[slot].copy_(src)
        out, weights = _route_slots(store, n, query, gain, heads, eps, impl, tail)
        weights = weights.detach()
        ctx.store, ctx.n, ctx.heads, ctx.eps, ctx.impl = store, n, heads, eps, impl
        ctx.reader, store.n_reads = store.n_reads, store.n_reads + 1
        ctx.written = [(slot, src.dtype) for slot, src in zip(slots, written)]
        ctx.save_for_backward(query, gain, weights, out, tail)
        ctx.mark_non_differentiable(weights)
        return out, weights, token.new_empty(())

    @staticmethod
    def backward(ctx, dout: Tensor | None, _dweights: Tensor | None, _dtoken: Tensor | None):
        store = ctx.store
        query, gain, weights, out, tail = ctx.saved_tensors
        if store.deferred:
            return _BufferedRoute._deferred_backward(ctx, store, dout, query, gain, weights, out, tail)
        dquery = dgain = dtail = None
        if dout is not None:
            grad = store.grad_slots(ctx.n)
            backward_kernel = _triton_backward() if ctx.impl == "triton" else None
            if backward_kernel is not None:
                _, dtail, dquery, dgain = backward_kernel(store.buf[:ctx.n], query, gain, weights, out,
                                                          dout.contiguous(), ctx.heads, ctx.eps,
                                                          accumulate_into=grad, tail=tail)
            else:  # recompute the route (tail in slot n, as the forward had it) and differentiate
                n = _tail_into_slot(store, ctx.n, tail)
                with torch.enable_grad():
                    s = store.buf[:n].detach().requires_grad_(True)
                    q = query.detach().requires_grad_(True)
                    g = gain.detach().requires_grad_(True)
                    out = route(s, q, g, ctx.heads, ctx.eps, ctx.impl)
                    dsources, dquery, dgain = torch.autograd.grad(out, (s, q, g), dout)
                grad.add_(dsources[:ctx.n])
                if tail is not None:
                    dtail = dsources[ctx.n].to(tail.dtype)
        dwritten = [store.take_grad(slot, dtype) for slot, dtype in ctx.written]
        return _BufferedRoute._delivered(ctx, store, dquery, dgain, dtail, dwritten)

    @staticmethod
    def _deferred_backward(ctx, store: SourceBuffer, dout: Tensor | None, query: Tensor, gain: Tensor,
                           weights: Tensor, out: Tensor, tail: Tensor | None):
        """Keep this read's terms; then assemble the gradients of the sources it wrote, whose other
        readers (all later ones) have kept theirs already."""
        kept = store.kept_terms(ctx.heads)
        dquery = dgain = dtail = None
        if dout is None:
            kept.skip(ctx.reader)
        else:
            _, dtail, dquery, dgain = _triton_backward()(store.buf[:ctx.n], query, gain, weights, out,
                                                         dout.contiguous(), ctx.heads, ctx.eps, tail=tail,
                                                         defer=kept, reader=ctx.reader)
        dwritten = []
        for slot, dtype in ctx.written:
            ds = kept.assemble(store.buf[slot], slot, ctx.reader, ctx.eps, store.grad_dtype)
            dwritten.append(None if ds is None else ds.to(dtype))
        return _BufferedRoute._delivered(ctx, store, dquery, dgain, dtail, dwritten)

    @staticmethod
    def _delivered(ctx, store: SourceBuffer, dquery, dgain, dtail, dwritten):
        """The backward's return, after freeing the buffers if this is the forward's first read."""
        if any(slot == 0 for slot, _ in ctx.written):  # the forward's first read: all delivered
            store.buf = store.grad = store.kept = None
        return (None, None, None, None, None, None, dquery, dgain, None, dtail, *dwritten)


@torch.compiler.disable
def _buffered_route(stream: DepthRouting, state: DepthState, query: Tensor, gain: Tensor,
                    ) -> tuple[Tensor, Tensor]:
    """Route over the buffered sources of ``state`` and its partial sum, writing pending sources first.

    Opaque to dynamo in a ``torch.compile``d model: it would otherwise trace the in-place buffer
    writes and guard on the state (its number of sources differs at every site), recompiling the
    calling frame per site until it hits its recompile limit. As a graph break it costs one break
    per read; the kernel inside still runs compiled (``compile``) or fused (``triton``).
    """
    if state.store is None:
        state.store = SourceBuffer(stream.n_blocks + 1, state.rows, stream.d, state.dtype, state.device,
                                   stream.grad_dtype,
                                   deferred=stream.backward_mode == "deferred" and state.impl == "triton")
        if torch.is_grad_enabled():
            state.token = torch.empty((), device=state.device, requires_grad=True)
    store, n, tail = state.store, state.n_done, state.partial
    if tail is not None:  # the kernels address it with the buffer's row stride
        tail = tail.contiguous()
    written, state.pending = state.pending, []
    if state.token is None or not torch.is_grad_enabled():  # no backward: no bookkeeping
        for slot, src in written:
            store.buf[slot].copy_(src.detach())
        return _route_slots(store, n, query, gain, stream.heads, stream.eps, state.impl,
                            None if tail is None else tail.detach())
    slots = tuple(slot for slot, _ in written)
    out, weights, state.token = _BufferedRoute.apply(store, n, slots, stream.heads, stream.eps, state.impl,
                                                     query, gain, state.token, tail, *(s for _, s in written))
    return out, weights


@torch.compiler.disable
def _without_dynamo(fn, *args):
    """``fn(*args)``, run outside dynamo even inside a compiled model (see ``DepthRouting.read``)."""
    return fn(*args)


# ---- shared machinery -----------------------------------------------------------------------------
class DepthRouting(nn.Module):
    """Sources, blocks, routing sites and recording shared by ``attnres`` and ``delta``."""

    first_label = "emb"
    unit_label = "block"

    def __init__(self, cfg: "ModelConfig", specs: "list[LayerSpec]", n_blocks: int):
        super().__init__()
        self.d = max([base_width(cfg)] + [s.d for s in specs])  # sources are stored this wide
        self.varying_width = any(s.d != self.d for s in specs)
        # ``specs``: one per visit of the layer schedule (``Transformer.visit_specs``)
        self.n_visits = len(specs)
        self.n_sites = 2 * self.n_visits
        self.heads = cfg.residual.heads
        self.eps = cfg.norm_eps
        self.impl = cfg.residual.impl
        self.n_blocks = n_blocks
        self.bounds = block_bounds(self.n_sites, n_blocks)
        self.block_of = [j for j in range(n_blocks) for _ in range(self.bounds[j], self.bounds[j + 1])]
        #: force the buffered (True) or list (False) source store; None: buffered unless the
        #: resolved impl is ``reference``.
        self.buffered: bool | None = None
        #: dtype of the buffered path's source-gradient buffer; None: the sources' dtype
        self.grad_dtype: torch.dtype | None = _DTYPES.get(cfg.residual.grad_dtype)
        #: how the Triton path's backward forms each source's gradient (``residual.backward``)
        self.backward_mode = cfg.residual.backward
        #: dtype the sources are stored (and routed) in; None: the autocast dtype under autocast,
        #: else the embedding's (``residual.source_dtype`` in the config says why)
        self.source_dtype: torch.dtype | None = _DTYPES.get(cfg.residual.source_dtype)
        self.recorder: RoutingRecorder | None = None
        n_reads = self.n_sites + 1
        self.queries = nn.ParameterList(nn.Parameter(torch.zeros(self.d)) for _ in range(n_reads))
        self.gains = nn.ParameterList(nn.Parameter(torch.ones(self.d)) for _ in range(n_reads))

    def init_parameters(self, init: "Init") -> None:
        """Identity-style init whatever the init kind: zero queries (uniform routing), unit gains."""
        with torch.no_grad():
            for q in self.queries:
                q.zero_()
            for g in self.gains:
                g.fill_(1.0)

    def extra_repr(self) -> str:
        return (f"d={self.d}, sites={self.n_sites}+1, blocks={self.n_blocks}, heads={self.heads}, "
                f"impl={self.impl}")

    # ---- labels -----------------------------------------------------------------------------------
    def _unit_name(self, j: int) -> str:
        if self.n_blocks == self.n_sites:
            return site_label(j, self.n_visits)
        return f"{self.unit_label}{j + 1}"

    def source_labels(self, site: int) -> list[str]:
        """Names of the sources read at ``site`` (``2L`` = the final read), in routing order."""
        if site == self.n_sites:
            return [self.first_label] + [self._unit_name(j) for j in range(self.n_blocks)]
        j = self.block_of[site]
        labels = [self.first_label] + [self._unit_name(i) for i in range(j)]
        if site > self.bounds[j]:
            labels.append(f"{self.unit_label}{j + 1}.partial")
        return labels

    # ---- recording ---------------------------------------------------------------------------------
    @contextmanager
    def recording(self, sources: bool = False) -> Iterator[RoutingRecorder]:
        """Collect routing weights (and with ``sources`` the sources and reads) of every read."""
        rec = RoutingRecorder(sources=sources)
        previous, self.recorder = self.recorder, rec
        try:
            yield rec
        finally:
            self.recorder = previous

    # ---- state ------------------------------------------------------------------------------------
    def _use_buffer(self, device: torch.device) -> tuple[str, bool]:
        impl = resolve_impl(self.impl, device)
        buffered = self.buffered if self.buffered is not None else impl != "reference"
        return impl, buffered and not self.varying_width

    def _new_state(self, x0: Tensor, first: Tensor, ctx: Context) -> DepthState:
        """A state whose first source is ``first`` [M, d]."""
        impl, buffered = self._use_buffer(x0.device)
        autocast = torch.is_autocast_enabled(x0.device.type)
        dtype = self.source_dtype
        if dtype is None:
            dtype = torch.get_autocast_dtype(x0.device.type) if autocast else x0.dtype
        state = DepthState(shape=x0.shape, width=x0.shape[-1], dtype=dtype, device=x0.device, rows=first.shape[0],
                           impl=impl,
                           buffered=buffered, read_dtype=None if autocast or dtype == x0.dtype else x0.dtype)
        state.stream = ctx.rows.group
        self._complete(state, first)
        return state

    def _complete(self, state: DepthState, src: Tensor) -> None:
        if state.buffered:  # the next read writes it into its slot
            state.pending.append((state.n_done, src))
        else:
            state.done.append(src)
        state.n_done += 1

    def _accumulate(self, state: DepthState, site: int, out: Tensor) -> None:
        """Add sublayer ``site``'s output to its block; a finished block becomes a source."""
        o = out.reshape(state.rows, out.shape[-1])
        if o.shape[-1] < self.d:  # a narrower layer's output: zero beyond its width
            o = torch.nn.functional.pad(o, (0, self.d - o.shape[-1]))
        j = self.block_of[site]
        if self.n_blocks == self.n_sites:  # full: the raw output is the source
            self._complete(state, o)
            return
        o = o.to(state.dtype)
        state.partial = o if site == self.bounds[j] else state.partial + o
        if site == self.bounds[j + 1] - 1:
            self._complete(state, state.partial)
            state.partial = None

    def _route(self, state: DepthState, site: int) -> Tensor:
        """The routed value [M, d] at read ``site`` (``2L`` = final) in the state's dtype."""
        query, gain = self.queries[site], self.gains[site]
        impl = state.impl
        want = self.recorder is not None
        if state.buffered:
            out, weights = _buffered_route(self, state, query, gain)
            sources = None
            if want:
                sources = state.store.buf[:state.n_done]
                if state.partial is not None:
                    sources = torch.cat([sources, state.partial.unsqueeze(0)])
        else:
            srcs = state.done + ([state.partial] if state.partial is not None else [])
            sources = torch.stack([s.to(state.dtype) for s in srcs])
            if state.width < self.d:  # a narrower layer reads every source's first coordinates
                sources, query, gain = sources[..., :state.width], query[:state.width], gain[:state.width]
            if want:
                out, weights = route(sources, query, gain, self.heads, self.eps, impl, return_weights=True)
            else:
                out, weights = route(sources, query, gain, self.heads, self.eps, impl), None
        if want:
            self.recorder.add(state.stream, site, self.source_labels(site), weights, sources, out)
        return out if state.read_dtype is None else out.to(state.read_dtype)

    # ---- the stream interface ---------------------------------------------------------------------
    # ``_read`` / ``_write`` are the stream's own logic. A buffered read is a graph break in a
    # compiled model, and one inside the model's loop over layers makes dynamo run that loop
    # eagerly and compile each sublayer and each of these calls as separate frames. These frames
    # index per-site lists, so dynamo would compile them once per site until its recompile limit
    # (8) and then run them uncompiled anyway; for buffered states they skip dynamo from the start.
    # The list path has no graph break, and its model compiles as one graph.
    @abstractmethod
    def _read(self, state: DepthState, site: int) -> Tensor:
        """The sublayer input at ``site`` (``2L`` = the model output, before the final norm)."""

    @abstractmethod
    def _write(self, state: DepthState, site: int, out: Tensor) -> None:
        """Record sublayer ``site``'s output ``out`` in ``state``."""

    def read(self, state: DepthState, site: int) -> Tensor:
        if state.buffered:
            return _without_dynamo(self._read, state, site)
        return self._read(state, site)

    def write(self, state: DepthState, site: int, out: Tensor) -> DepthState:
        if state.buffered:
            _without_dynamo(self._write, state, site, out)
        else:
            self._write(state, site, out)
        return state

    def final(self, state: DepthState) -> Tensor:
        return self.read(state, self.n_sites)

    def resize(self, state: DepthState, width: int, seen: list[Tensor]) -> DepthState:
        state.width = width
        if state.p is not None:
            state.p = resize_stream(state.p, width, seen)
        return state

    # ---- cost ---------------------------------------------------------------------------------------
    @staticmethod
    def _read_widths(specs: "list[LayerSpec]") -> list[int]:
        """The width of each read: sites 0..2L-1 at their visit's width, then the final read."""
        return [specs[site // 2].d for site in range(2 * len(specs))] + [specs[-1].d]

    @staticmethod
    def _read_flops(cfg: "ModelConfig", specs: "list[LayerSpec]", n_blocks: int) -> int:
        s = 2 * len(specs)
        widths = DepthRouting._read_widths(specs)
        flops = sum(7 * n * w for n, w in zip(read_source_counts(cfg, n_blocks), widths))
        firsts = set(block_bounds(s, n_blocks)[:-1])
        # partial sums: every output but each block's first is an add
        return flops + sum(widths[site] for site in range(s) if n_blocks < s and site not in firsts)

    @staticmethod
    def _stored_width(cfg: "ModelConfig", specs: "list[LayerSpec]") -> int:
        return max([base_width(cfg)] + [s.d for s in specs])


class AttnResResidual(DepthRouting):
    """Full / block AttnRes with ``heads`` routing heads (MHAR); see the module docstring."""

    def __init__(self, cfg: "ModelConfig", specs: "list[LayerSpec]"):
        super().__init__(cfg, specs, attnres_blocks(cfg))

    def start(self, x0: Tensor, ctx: Context) -> DepthState:
        return self._new_state(x0, x0.reshape(-1, x0.shape[-1]), ctx)

    def _read(self, state: DepthState, site: int) -> Tensor:
        return self._route(state, site).view(*state.shape[:-1], state.width)

    def _write(self, state: DepthState, site: int, out: Tensor) -> None:
        self._accumulate(state, site, out)

    @classmethod
    def cost(cls, cfg: "ModelConfig", specs: "list[LayerSpec]") -> Cost:
        return Cost(params=(2 * len(specs) + 1) * 2 * cls._stored_width(cfg, specs),
                    flops=cls._read_flops(cfg, specs, attnres_blocks(cfg)))


class DeltaResidual(DepthRouting):
    """Standard stream plus a gated multi-head route over a null source and group deltas."""

    first_label = "null"
    unit_label = "group"

    def __init__(self, cfg: "ModelConfig", specs: "list[LayerSpec]"):
        super().__init__(cfg, specs, delta_groups(cfg))
        self.null = nn.Parameter(torch.zeros(self.d))
        self.gates = nn.Parameter(torch.zeros(self.n_sites + 1))

    def _unit_name(self, j: int) -> str:
        return f"{self.unit_label}{j + 1}"

    def init_parameters(self, init: "Init") -> None:
        super().init_parameters(init)
        with torch.no_grad():
            self.null.zero_()
            self.gates.zero_()

    def start(self, x0: Tensor, ctx: Context) -> DepthState:
        rows = x0.numel() // x0.shape[-1]
        state = self._new_state(x0, self.null.to(x0.dtype).expand(rows, self.d), ctx)
        state.p = x0
        return state

    def _read(self, state: DepthState, site: int) -> Tensor:
        r = self._route(state, site).view(*state.shape[:-1], state.width)
        return state.p + self.gates[site].to(r.dtype) * r

    def _write(self, state: DepthState, site: int, out: Tensor) -> None:
        state.p = state.p + out
        self._accumulate(state, site, out)

    @classmethod
    def cost(cls, cfg: "ModelConfig", specs: "list[LayerSpec]") -> Cost:
        reads, d = 2 * len(specs) + 1, cls._stored_width(cfg, specs)
        return Cost(params=reads * (2 * d + 1) + d,
                    flops=cls._read_flops(cfg, specs, delta_groups(cfg)) + sum(2 * w for w in cls._read_widths(specs)))
