"""TriPLU: a product of projections as the feed-forward sublayer.

    y = W_o N( (W_1 x) * (W_2 x) * ... * (W_k x) ),   k = model.triplu.degree (default 3)

* ``N`` (``model.triplu.norm``, default on) is an RMSNorm over the hidden width, computed in fp32,
  with a learnable gain (ones at init) and ``eps = model.norm_eps``; off, ``N`` is the identity.
* **Hidden width.** ``k + 1`` matrices of ``d x h`` (plus ``h`` norm gains) against SwiGLU's
  ``3 d H`` (``H`` the layer's dense hidden): ``h* = 3 d H / ((k + 1) d + [norm])``, rounded to
  the nearest multiple of ``model.triplu.multiple_of``; when that is 0 (default) the multiple is
  the largest of 64, 32, 16, 8, 4, 2, 1 whose nearest multiple stays within
  ``model.triplu.tolerance`` (1%) of SwiGLU's parameters. Degree 3 at ``d = 768``: ``h = 1536``
  (multiple of 64); degree 4: ``1232`` (16); degree 2: ``2048``; at ``d = 64``: 144 / 114 / 192.
  ``model.triplu.hidden`` overrides the solve.
* **Init.** ``W_1 .. W_k`` (one fused ``[k h, d]`` matrix, role ``in``) are drawn by the init kind
  and multiplied by ``model.triplu.init_scale`` (default 0.5: with the baseline's normal init a
  std of 0.01); ``W_o`` (role ``out``) is the init kind's draw.
* **Decode branch.** The hidden activation the branch couples to (``u``, tapped through
  ``ctx.rows.tap``) is ``N(product)``, the tensor ``W_o`` reads, as SwiGLU taps what its down
  projection reads; ``coupling_width`` is ``h``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from archlab.model.core.context import Context
from archlab.model.core.cost import Cost
from archlab.model.core.layers import Linear

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.init import Init
    from archlab.model.core.spec import LayerSpec


def params_per_unit(d: int, degree: int, norm: bool) -> int:
    """Parameters per hidden unit: ``degree`` input columns, one output row, one norm gain."""
    return (degree + 1) * d + (1 if norm else 0)


def solve_hidden(cfg: "ModelConfig", spec: "LayerSpec") -> int:
    t = cfg.triplu
    if t.hidden:
        return t.hidden
    d = spec.d
    target = 3 * d * spec.hidden  # SwiGLU's parameters at this width
    per = params_per_unit(d, t.degree, t.norm)
    exact = target / per
    for m in ([t.multiple_of] if t.multiple_of else [64, 32, 16, 8, 4, 2, 1]):
        h = max(m, m * round(exact / m))
        if t.multiple_of or abs(h * per - target) <= t.tolerance * target:
            return h
    return max(1, round(exact))  # a tiny width (h < 50) can miss the tolerance even at m = 1


class TriPLU(nn.Module):
    """``W_o N(prod_k W_k x)``; see the module docstring."""

    def __init__(self, cfg: "ModelConfig", spec: "LayerSpec"):
        super().__init__()
        t = cfg.triplu
        self.layer = spec.layer
        self.degree = t.degree
        self.hidden = h = solve_hidden(cfg, spec)
        self.init_scale = t.init_scale
        self.eps = cfg.norm_eps
        self.w_in = Linear(spec.d, t.degree * h)  # W_1 .. W_k stacked: one matmul
        self.w_out = Linear(h, spec.d)
        self.norm_weight = nn.Parameter(torch.ones(h)) if t.norm else None

    def init_parameters(self, init: "Init") -> None:
        init.linear(self.w_in.weight, role="in")
        with torch.no_grad():
            self.w_in.weight.mul_(self.init_scale)
        init.linear(self.w_out.weight, role="out")
        if self.norm_weight is not None:
            with torch.no_grad():
                self.norm_weight.fill_(1.0)

    def product(self, x: Tensor) -> Tensor:
        """``N(prod_k W_k x)`` [..., h]."""
        parts = self.w_in(x).split(self.hidden, dim=-1)
        p = parts[0]
        for q in parts[1:]:
            p = p * q
        if self.norm_weight is None:
            return p
        pf = p.float() if p.dtype not in (torch.float32, torch.float64) else p
        y = pf * torch.rsqrt(pf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.norm_weight.to(y.dtype)).type_as(p)

    def forward(self, x: Tensor, ctx: Context) -> Tensor:
        u = ctx.rows.tap(ctx.visit, "u", self.product(x))
        return self.w_out(u)

    @classmethod
    def cost(cls, cfg: "ModelConfig", spec: "LayerSpec") -> Cost:
        t = cfg.triplu
        h = solve_hidden(cfg, spec)
        matrices = (t.degree + 1) * spec.d * h
        return Cost(params=matrices + (h if t.norm else 0), flops=2 * matrices)

    @classmethod
    def coupling_width(cls, cfg: "ModelConfig", spec: "LayerSpec") -> int:
        return solve_hidden(cfg, spec)
