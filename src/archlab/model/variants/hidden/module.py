"""Hidden Decoding's rows: ``n`` embedded streams per token, stream-factorised attention.

Each token ``t`` becomes ``n`` rows, stream ``s`` embedded by its own table (streams ``0..n-2``
by ``stream_emb``, the last by the token embedding itself, so a model with one stream is the
baseline, and a converted checkpoint keeps its table where the scored stream reads it). The
streams are interleaved into one sequence of ``n*T`` positions, ``(t, s)`` at ``t*n + s``; only
stream ``n-1`` is unembedded and scored, so the logits and the loss are over ``T`` positions.

**Layout.** The streams are rows of the activation, stream-major ([n*B, T, d]: row ``s*B + b`` is
stream ``s`` of sequence ``b``), so every per-token op (projections, FFN, norms, the residual
stream) runs on them unchanged, and attention in a *within-stream* layer is the baseline's causal
attention of ``n*B`` independent T-long sequences: no n*T x n*T mask or score matrix exists. In a
*mixing* layer (``mix_layers``) the pass's ``attend`` interleaves the rotated queries, keys and
values of a sequence's streams into [B, H, n*T, hd] and attends causally over that order, so
``(t, s)`` sees every stream of earlier tokens and streams ``0..s`` of its own token.

**Positions.** A token's streams share its position ``t`` (RoPE, cache slot): the within-stream
layers then see exactly the baseline's relative positions, one stream is the baseline bit for
bit, ``max_seq_len`` still counts tokens, and a converted checkpoint's rotations keep their
meaning. Inside a token the streams are told apart by their embeddings and the causal order.

**Cache.** ``n`` cache rows per sequence (``cache_batch``): stream ``s`` of the sequence in cache
row ``c`` lives in row ``s*C + c`` (``C``: the cache's sequences), slot ``t``; a within-stream
layer reads its own row like a baseline decode, a mixing layer all ``n`` rows of its sequence. A
decode step runs the new token's ``n`` streams together: in a mixing layer stream ``s`` sees the
new token's streams ``0..s``, whose keys/values the same step wrote first.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from archlab.kernels.linear_cross_entropy import linear_cross_entropy
from archlab.model.core.context import Context, Pass
from archlab.model.core.cost import Cost
from archlab.model.core.layers import sdpa
from archlab.model.core.rows import PrimaryRows, last_of, run_layers
from archlab.model.core.spec import base_width, layer_visits

if TYPE_CHECKING:
    from archlab.model.accounting import Part
    from archlab.model.config import ModelConfig
    from archlab.model.core.decoder import Transformer
    from archlab.model.core.init import Init
    from archlab.model.core.spec import LayerSpec


def interleave(x: Tensor, n: int) -> Tensor:
    """Stream-major rows [n*B, H, T, hd] as one interleaved sequence per batch row [B, H, T*n, hd]."""
    rows, h, t, hd = x.shape
    return x.view(n, rows // n, h, t, hd).permute(1, 2, 3, 0, 4).reshape(rows // n, h, t * n, hd)


def deinterleave(x: Tensor, n: int) -> Tensor:
    """The inverse of ``interleave``: [B, H, T*n, hd] back to stream-major rows [n*B, H, T, hd]."""
    b, h, tn, hd = x.shape
    return x.view(b, h, tn // n, n, hd).permute(3, 0, 1, 2, 4).reshape(n * b, h, tn // n, hd)


class StreamPass(Pass):
    """A run whose rows are the ``n`` streams of its sequences, stream-major; mixing visits
    attend across a sequence's streams, every other visit within each stream."""

    def __init__(self, streams: int, mixing_visits: frozenset[int]) -> None:
        self.streams = streams
        self.mixing_visits = mixing_visits

    def attend(self, visit: int, attention: Any, q: Tensor, k: Tensor, v: Tensor, ctx: Context, lead: int,
               q_tail: Tensor | None) -> Tensor:
        if self.streams == 1 or visit not in self.mixing_visits:
            return attention._attend(q, k, v, ctx, lead, q_tail)
        n = self.streams
        if ctx.mask is None:  # training, evaluation, a fresh prefill: causal over the interleaved order
            o = sdpa(interleave(q, n), interleave(k, n), interleave(v, n), causal=True, sink=attention.sink)
            return deinterleave(o, n)
        return self._attend_cache(attention, q, k, v, ctx)

    def _attend_cache(self, attention: Any, q: Tensor, k: Tensor, v: Tensor, ctx: Context) -> Tensor:
        """One new token per sequence (a decode step): its ``n`` streams, queries [n*B, H, 1, hd],
        over every stream's cache rows [n*B, KVH, S, hd] of their sequence."""
        n = self.streams
        rows, h, t, hd = q.shape
        if t != 1:
            raise ValueError("a cached mixing layer runs one new token per sequence (a decode step)")
        b, kvh, slots = rows // n, k.shape[1], k.shape[2]
        queries = q.view(n, b, h, hd).permute(1, 2, 0, 3)  # [B, H, n, hd]: stream s is query s
        keys = k.view(n, b, kvh, slots, hd).permute(1, 2, 0, 3, 4).reshape(b, kvh, n * slots, hd)
        values = v.view(n, b, kvh, slots, hd).permute(1, 2, 0, 3, 4).reshape(b, kvh, n * slots, hd)
        position = ctx.positions[:b, 0]  # stream-major rows: the first B are stream 0, same positions
        at = torch.arange(slots, device=q.device)[None]
        earlier = at < position[:, None]  # [B, S]: every stream of an earlier token
        current = at == position[:, None]  # the new token: key stream s' <= query stream s
        order = torch.arange(n, device=q.device)
        own = order[None, :] <= order[:, None]  # [n (query), n (key stream)]
        mask = earlier[:, None, None, :] | (current[:, None, None, :] & own[None, :, :, None])
        o = sdpa(queries, keys, values, mask=mask.reshape(b, 1, n, n * slots), sink=attention.sink)
        return o.permute(2, 0, 1, 3).reshape(rows, h, 1, hd)


class HiddenRows(PrimaryRows):
    def __init__(self, cfg: "ModelConfig"):
        super().__init__(cfg)
        self.streams = cfg.hidden_decoding.streams
        mixing = cfg.hidden_decoding.mixing(cfg.n_layers)
        # Keyed by visit (a looped schedule runs a mixing layer's every visit across streams).
        self.mixing_visits = frozenset(v for v, layer in enumerate(layer_visits(cfg)) if layer in mixing)

    # ---- building -------------------------------------------------------------------------------
    def attach_embeddings(self, model: "Transformer") -> None:
        if self.streams > 1:  # the hidden streams' tables, stacked [(n - 1) * V, d]
            model.stream_emb = nn.Embedding((self.streams - 1) * model.cfg.vocab_size, model.base_width)

    def init_parameters(self, model: "Transformer", init: "Init") -> None:
        if self.streams > 1:
            init.embedding(model.stream_emb.weight)

    def cache_batch(self, sequences: int) -> int:
        return self.streams * sequences

    @classmethod
    def cost(cls, cfg: "ModelConfig", specs: "list[LayerSpec]") -> Cost:
        extra = cfg.hidden_decoding.streams - 1
        d = base_width(cfg)
        embed = extra * cfg.vocab_size * d
        # a decode step reads one row of each hidden stream's table per sequence
        return Cost(params=embed, embedding=embed, decode_params=lambda batch: batch * extra * d)

    @classmethod
    def per_token_parts(cls, cfg: "ModelConfig", parts: "list[Part]") -> "list[Part]":
        """Every part but the unembedding runs once per stream. A query of a mixing layer at
        ``(t, s)`` attends to ``t*n + s + 1`` keys where a stream's query attends to ``t + 1``:
        ``n * keys - (n - 1) / 2`` on average over a token's streams, for a prefill's mean
        (``keys = (S + 1) / 2``) and a decode step (``keys = C``) alike, which the part states as
        ``n`` times the score FLOPs per key and a constant ``(n - 1) / 2`` keys fewer."""
        n = cfg.hidden_decoding.streams
        mixing = cfg.hidden_decoding.mixing(cfg.n_layers)
        out = []
        for part in parts:
            c = part.cost
            if part.name == "head" or n == 1:
                out.append(part)
                continue
            per_key = c.score_flops_per_key
            mixed = part.layer in mixing and per_key > 0
            scaled = dataclasses.replace(
                c, flops=n * (c.flops - (per_key * (n - 1) / 2 if mixed else 0)),
                flops_follower=None if c.flops_follower is None else n * c.flops_follower,
                score_flops_per_key=n * per_key * (n if mixed else 1), kv_elems=n * c.kv_elems)
            out.append(dataclasses.replace(part, cost=scaled))
        return out

    # ---- running --------------------------------------------------------------------------------
    def embed(self, model: "Transformer", idx: Tensor) -> Tensor:
        """The streams of tokens ``idx`` [B, T]: [n*B, T, d], stream-major, the scored one last."""
        scored = model.tok_emb(idx)
        if self.streams == 1:
            return scored
        offsets = torch.arange(self.streams - 1, device=idx.device) * model.cfg.vocab_size
        hidden = model.stream_emb((idx[None] + offsets[:, None, None]).flatten(0, 1))
        return torch.cat([hidden, scored])

    def _pass(self, ctx: Context) -> Context:
        return dataclasses.replace(ctx, rows=StreamPass(self.streams, self.mixing_visits))

    def _stream_cache_rows(self, ctx: Context, batch: int) -> Tensor | None:
        """Cache rows of every stream of the run's sequences, stream-major; None when they are the
        cache's rows in order (a decode step over every slot: no gather of the cache)."""
        sequences = ctx.cache.batch // self.streams
        if ctx.cache_rows is None and batch == sequences:
            return None
        rows = ctx.cache_rows if ctx.cache_rows is not None else torch.arange(batch, device=ctx.positions.device)
        offsets = torch.arange(self.streams, device=rows.device) * sequences
        return (offsets[:, None] + rows[None]).flatten()

    def forward(self, model: "Transformer", idx: Tensor, ctx: Context, followers: bool = True,
                exit_after: int | None = None) -> tuple[Tensor, Tensor | None]:
        """``followers=False``: the scored stream alone (the model without its hidden streams)."""
        if not followers:
            return super().forward(model, idx, ctx, exit_after=exit_after)
        return model.logits(self._scored(model, idx, ctx, exit_after)), None

    def _scored(self, model: "Transformer", idx: Tensor, ctx: Context, exit_after: int | None) -> Tensor:
        """The scored stream's final hidden states [B, T, d] of a full causal forward."""
        hidden = run_layers(model, self.embed(model, idx), self._pass(ctx), exit_after)
        return hidden[(self.streams - 1) * idx.shape[0]:]

    def fused_nll(self, model: "Transformer", idx: Tensor, targets: Tensor, ctx: Context,
                  exit_after: int | None) -> Tensor | None:
        """``nll`` without the logits kept: the plain readout of the scored stream."""
        hidden = self._scored(model, idx, ctx, exit_after)
        return linear_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, targets.flatten())

    def prefill(self, model: "Transformer", idx: Tensor, ctx: Context, lengths: Tensor,
                exit_after: int | None = None) -> Tensor:
        b, n = idx.shape[0], self.streams
        ctx = dataclasses.replace(self._pass(ctx), positions=ctx.positions.repeat(n, 1),
                                  cache_rows=self._stream_cache_rows(ctx, b))
        hidden = run_layers(model, self.embed(model, idx), ctx, exit_after)
        return self.log_probs(model.logits(last_of(hidden[(n - 1) * b:], lengths)), None)[:, 0]

    def decode(self, model: "Transformer", idx: Tensor, ctx: Context, exit_after: int | None = None) -> Tensor:
        b, n = idx.shape[0], self.streams
        ctx = self._pass(model.cache_context(ctx.cache, ctx.positions.repeat(n, 1), self._stream_cache_rows(ctx, b)))
        hidden = run_layers(model, self.embed(model, idx), ctx, exit_after)
        return self.log_probs(model.logits(hidden[(n - 1) * b:]), None)[:, 0]
