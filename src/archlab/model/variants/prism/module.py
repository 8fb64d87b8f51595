"""Prism heads: per-layer (query heads, kv heads, head dim) rising in head count with depth.

The query width is the base config's, ``q_dim = n_heads * head_dim`` (``d_model`` unless
``model.head_dim`` is set), in every layer; only its split into heads changes. With the GQA group
``g = n_heads / n_kv_heads`` kept per layer, a layer of head dim ``hd`` has ``q_dim / hd`` query
heads and ``q_dim / (g hd)`` kv heads, so ``kv_dim = q_dim / g`` too: every projection, FLOP and
KV-cache element is the baseline's (attention scores cost ``4 q_dim`` per key whatever the split).

**Rule** (``model.prism.head_dims = [h_0, .., h_{S-1}]``, default ``[256, 128, 64]``). The ``L``
layers are split into ``S`` contiguous depth stages by the same rule as AttnRes blocks: stage ``j``
holds layers ``floor(j L / S) .. floor((j+1) L / S) - 1`` (sizes differ by at most one; for
``L = 12, S = 3``: 0-3, 4-7, 8-11). A layer of stage ``j`` gets head dim ``min(h_j, cap)`` where
``cap`` is the largest power of two dividing ``q_dim / g`` (the widest power-of-two head whose
count is a whole multiple of ``g``). Clipping keeps the dims non-increasing, so the head count
never falls with depth; it may be flat (``d = 64`` clips all three default stages to 64).

**Explicit list** (``model.prism.heads``): query heads per layer, non-decreasing, each a multiple
of ``g`` whose head dim ``q_dim / heads`` is a power of two.

Imports no torch: ``layer_specs`` (and so ``archlab info``) reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig


def head_dim_cap(q_dim: int, group: int) -> int:
    """The largest power of two dividing ``q_dim / group`` (0 when that is not an integer)."""
    if q_dim % group:
        return 0
    n = q_dim // group
    return n & -n


def stage_of(layer: int, n_layers: int, n_stages: int) -> int:
    """The depth stage of ``layer``: stage ``j`` holds ``floor(jL/S) .. floor((j+1)L/S) - 1``."""
    return max(j for j in range(n_stages) if j * n_layers // n_stages <= layer)


def schedule(cfg: "ModelConfig") -> list[tuple[int, int, int]]:
    """(query heads, kv heads, head dim) of every layer."""
    p = cfg.prism
    group = cfg.n_heads // cfg.kv_heads
    q_dim = cfg.n_heads * cfg.dim_per_head
    if p.heads is not None:
        dims = [q_dim // h for h in p.heads]
    else:
        cap = head_dim_cap(q_dim, group)
        dims = [min(p.head_dims[stage_of(l, cfg.n_layers, len(p.head_dims))], cap) for l in range(cfg.n_layers)]
    return [(q_dim // hd, q_dim // hd // group, hd) for hd in dims]


class PrismHeads:
    """The ``heads`` slot's ``prism`` kind (see the module docstring for the rule)."""

    def __init__(self, cfg: "ModelConfig") -> None:
        self.cfg = cfg
        self.table = schedule(cfg)

    def heads(self, layer: int, width: int) -> tuple[int, int, int]:
        return self.table[layer]
