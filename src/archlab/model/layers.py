"""Building blocks shared by every variant: RMSNorm, RoPE, attention, row groups.

A forward pass carries a list of *row groups* rather than one activation tensor: group 0 is the
primary path (the baseline model), group 1, when present, holds the decode-branch rows
(``n_branches * B`` rows at the same positions). Training keeps the groups apart so that the
primary computation is bit-for-bit the baseline's; grouped decoding concatenates them before each
matrix multiply so that a weight is read once for both rows (``fuse=True``). Group 0 may be ``None``
for the branch-only step that follows prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Groups = list[Tensor | None]

# enable_gqa arrived in torch 2.5; older versions get the keys/values repeated per query head.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32: bf16 sums of squares lose too much at large widths.
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)


def rope_tables(head_dim: int, positions: Tensor, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin of shape [*positions.shape, head_dim/2] in fp32."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.to(torch.float32)[..., None] * inv
    return ang.cos(), ang.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved-free halves (the Llama/HF convention) of x [B, H, T, hd].

    cos/sin are [T, hd/2] (shared positions) or [B, T, hd/2] (per-row positions).
    """
    if cos.dim() == 2:
        cos, sin = cos[None, None], sin[None, None]
    else:
        if cos.shape[0] != x.shape[0]:  # branch rows: n_branches copies of the batch, stacked
            reps = x.shape[0] // cos.shape[0]
            cos, sin = cos.repeat(reps, 1, 1), sin.repeat(reps, 1, 1)
        cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
    """Scaled dot-product attention with grouped-query heads (k/v may have fewer heads)."""
    if k.shape[1] != q.shape[1]:
        if _SDPA_HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def project(linear: nn.Module, xs: Groups, fuse: bool) -> Groups:
    """Apply one weight to every row group; with ``fuse`` as one matrix multiply."""
    live = [x for x in xs if x is not None]
    if fuse and len(live) > 1:
        parts = linear(torch.cat(live, dim=0)).split([x.shape[0] for x in live], dim=0)
        it = iter(parts)
        return [next(it) if x is not None else None for x in xs]
    return [linear(x) if x is not None else None for x in xs]


@dataclass
class AttnContext:
    """How attention sees keys/values in this forward.

    Without a cache: causal self-attention over the sequence (training, evaluation).
    With a cache: new keys/values are written at ``input_pos`` (slots, shared by the batch) and
    queries attend to every slot allowed by ``mask`` ([B, 1, T, S] boolean).
    """

    rope: dict[int, tuple[Tensor, Tensor]]  # head_dim -> (cos, sin)
    cache: "KVCache | None" = None
    input_pos: Tensor | None = None
    mask: Tensor | None = None
    stash: "CouplingStash | None" = None


@dataclass
class CouplingStash:
    """What the branch needs from the primary row at the last prompt position.

    Prefill runs the primary path only; the branch's first row (at the last prompt position) is
    run afterwards and reads the primary's per-layer activations from here instead of recomputing
    them. ``record`` is set during prefill, ``replay`` during the branch-only step.
    """

    record: bool = False
    values: dict[tuple[int, str], Tensor] = field(default_factory=dict)

    def put(self, layer: int, name: str, x: Tensor) -> None:
        if self.record:
            self.values[(layer, name)] = x[:, -1:].detach()

    def get(self, layer: int, name: str) -> Tensor:
        return self.values[(layer, name)]


class KVCache(nn.Module):
    """Static per-layer key/value buffers [B, kv_heads, max_len, head_dim] (gpt-fast style)."""

    def __init__(self, shapes: list[tuple[int, int]], batch: int, max_len: int, device, dtype):
        super().__init__()
        self.max_len = max_len
        for i, (kvh, hd) in enumerate(shapes):
            self.register_buffer(f"k{i}", torch.zeros(batch, kvh, max_len, hd, device=device, dtype=dtype),
                                 persistent=False)
            self.register_buffer(f"v{i}", torch.zeros(batch, kvh, max_len, hd, device=device, dtype=dtype),
                                 persistent=False)
        self.n_layers = len(shapes)

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return getattr(self, f"k{i}"), getattr(self, f"v{i}")

    def write(self, i: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        kc, vc = self.layer(i)
        kc.index_copy_(2, input_pos, k.to(kc.dtype))
        vc.index_copy_(2, input_pos, v.to(vc.dtype))
        return kc, vc


class Attention(nn.Module):
    """GQA self-attention; decode-branch rows query the primary's keys/values (shared KV)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_dim = n_heads * head_dim
        self.kv_dim = n_kv_heads * head_dim
        # One fused [q; k; v] projection: one matmul for the primary row. Branch rows use only its
        # query rows (they compute no keys/values).
        self.wqkv = nn.Linear(d_model, self.q_dim + 2 * self.kv_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, d_model, bias=False)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def forward(self, hs: Groups, ctx: AttnContext, layer: int, fuse: bool,
                couple_q: "QueryCoupling | None" = None) -> Groups:
        primary = hs[0]
        branch = hs[1] if len(hs) > 1 else None
        w = self.wqkv.weight
        k = v = None
        if primary is not None and branch is not None and fuse:
            # grouped decode: every weight row is read once for all rows
            q_all = F.linear(torch.cat([primary, branch]), w[: self.q_dim])
            qs: Groups = list(q_all.split([primary.shape[0], branch.shape[0]]))
            k, v = F.linear(primary, w[self.q_dim:]).split(self.kv_dim, dim=-1)
        else:
            qs = [None] * len(hs)
            if primary is not None:
                qs[0], k, v = self.wqkv(primary).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
            if branch is not None:
                qs[1] = F.linear(branch, w[: self.q_dim])
        if primary is not None and ctx.stash is not None:
            ctx.stash.put(layer, "q", qs[0])
        if couple_q is not None and branch is not None:
            q_src = qs[0] if primary is not None else ctx.stash.get(layer, "q")
            qs[1] = couple_q(q_src, qs[1])
        cos, sin = ctx.rope[self.head_dim]
        qs = [apply_rope(self._heads(q, self.n_heads), cos, sin) if q is not None else None for q in qs]

        if primary is not None:
            k = apply_rope(self._heads(k, self.n_kv_heads), cos, sin)
            v = self._heads(v, self.n_kv_heads)
            if ctx.cache is not None:
                k, v = ctx.cache.write(layer, ctx.input_pos, k, v)
        else:
            k, v = ctx.cache.layer(layer)

        outs = self._attend(qs, k, v, ctx, fuse)
        outs = [o.transpose(1, 2).reshape(o.shape[0], o.shape[2], self.q_dim) if o is not None else None
                for o in outs]
        return project(self.wo, outs, fuse)

    def _attend(self, qs: Groups, k: Tensor, v: Tensor, ctx: AttnContext, fuse: bool) -> Groups:
        q_p = qs[0]
        q_b = qs[1] if len(qs) > 1 else None
        batch = k.shape[0]
        if ctx.cache is None:
            # Training: causal over the sequence; the branch row at t sees primary K/V at <= t,
            # which is the same lower-triangular mask as the primary's own.
            out_p = sdpa(q_p, k, v, causal=True)
            out_b = None
            if q_b is not None:
                reps = q_b.shape[0] // batch
                kb, vb = (k, v) if reps == 1 else (k.repeat(reps, 1, 1, 1), v.repeat(reps, 1, 1, 1))
                out_b = sdpa(q_b, kb, vb, causal=True)
            return [out_p, out_b] if len(qs) > 1 else [out_p]

        # Cached: fold branch rows into the query-time axis so that every row of a sequence reads
        # that sequence's cache once; with ``fuse`` the primary joins the same call.
        mask = ctx.mask
        t = (q_p if q_p is not None else q_b).shape[2]
        folded = []
        if q_p is not None:
            folded.append(q_p)
        if q_b is not None:
            reps = q_b.shape[0] // batch
            qb = q_b.view(reps, batch, *q_b.shape[1:]).permute(1, 2, 0, 3, 4)
            folded.append(qb.reshape(batch, q_b.shape[1], reps * t, q_b.shape[3]))
        if fuse or len(folded) == 1:
            q_all = torch.cat(folded, dim=2) if len(folded) > 1 else folded[0]
            rows = q_all.shape[2] // t
            o = sdpa(q_all, k, v, mask=mask.repeat(1, 1, rows, 1) if rows > 1 else mask)
            parts = list(o.split([f.shape[2] for f in folded], dim=2))
        else:
            parts = [sdpa(f, k, v, mask=mask.repeat(1, 1, f.shape[2] // t, 1) if f.shape[2] > t else mask)
                     for f in folded]
        out_p = parts.pop(0) if q_p is not None else None
        out_b = None
        if q_b is not None:
            ob = parts.pop(0)
            reps = q_b.shape[0] // batch
            ob = ob.view(batch, q_b.shape[1], reps, t, q_b.shape[3]).permute(2, 0, 1, 3, 4)
            out_b = ob.reshape(reps * batch, q_b.shape[1], t, q_b.shape[3])
        return [out_p, out_b] if len(qs) > 1 else [out_p]


class QueryCoupling(nn.Module):
    """``q_b <- q_b + a * q_p`` per branch (zero-initialised: the branch starts uncoupled)."""

    def __init__(self, n_branches: int, dim: int):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(n_branches, dim))

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        reps = self.a.shape[0]
        b = src.shape[0]
        t = tgt.view(reps, b, *tgt.shape[1:]) + self.a[:, None, None, :] * src[None]
        return t.reshape(tgt.shape)


VectorCoupling = QueryCoupling  # the same mechanism for the MLP hidden (b) and output (c) vectors
