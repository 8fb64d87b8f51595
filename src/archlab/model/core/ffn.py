"""The ``ffn`` slot: the feed-forward sublayer. Its core kind is SwiGLU.

An FFN kind is a module built as ``cls(cfg, spec)`` with ``forward(x, ctx) -> Tensor``,
``init_parameters(init)``, and two classmethods: ``cost(cfg, spec)`` and ``coupling_width(cfg,
spec)``, the width of the hidden activation it taps as ``u`` (``ctx.rows.tap(ctx.visit, "u", u)``;
the decode branch couples its rows there), 0 when it taps none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor, nn

from archlab.model.core.context import Context, Pass
from archlab.model.core.cost import Cost
from archlab.model.core.layers import Linear, gated_linear

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.init import Init
    from archlab.model.core.spec import LayerSpec


class SwiGLU(nn.Module):
    """``W_down (silu(W_gate x) * W_up x)``; the gated product is the hidden activation ``u``.
    ``w_gate_up`` stacks ``W_gate`` over ``W_up`` (one matmul)."""

    def __init__(self, cfg: "ModelConfig", spec: "LayerSpec", hidden: int | None = None):
        super().__init__()
        self.layer = spec.layer
        self.hidden = hidden or spec.hidden
        self.w_gate_up = Linear(spec.d, 2 * self.hidden)
        self.w_down = Linear(self.hidden, spec.d)

    def init_parameters(self, init: "Init") -> None:
        init.linear(self.w_gate_up.weight, role="in")
        init.linear(self.w_down.weight, role="out")

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        h = self.w_gate_up(x)
        if type(ctx.rows).tap is Pass.tap and (fused := gated_linear(h, self.w_down.weight)) is not None:
            return fused  # a decode step's few rows: gated inside w_down's kernel (DECODE_SWIGLU)
        g, u = h.split(self.hidden, dim=-1)
        u = ctx.rows.tap(ctx.visit, "u", F.silu(g) * u)
        return self.w_down(u)

    @classmethod
    def cost(cls, cfg: "ModelConfig", spec: "LayerSpec") -> Cost:
        n = 3 * spec.d * spec.hidden
        return Cost(params=n, flops=2 * n)

    @classmethod
    def coupling_width(cls, cfg: "ModelConfig", spec: "LayerSpec") -> int:
        return spec.hidden
