"""Feed-forward sublayers. Each FFN type is one class registered under a config name.

An FFN receives the row groups (see ``layers``) and an optional ``couple_hidden`` callback that the
decode branch uses to add ``b * u_p`` to its hidden activation. ``aux_loss`` holds a training-time
auxiliary loss of the last forward (MoE load balancing), or ``None``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from archlab.config import ModelConfig
from archlab.model.layers import AttnContext, Groups, project

HiddenCoupling = Callable[[Tensor, Tensor], Tensor]

FFN_TYPES: dict[str, type["FFN"]] = {}


def register_ffn(name: str):
    def deco(cls):
        FFN_TYPES[name] = cls
        return cls
    return deco


class FFN(nn.Module, ABC):
    aux_loss: Tensor | None = None

    #: width of the hidden activation the branch's ``b`` vector couples (0: no hidden coupling)
    coupling_hidden: int = 0

    @abstractmethod
    def forward(self, hs: Groups, ctx: AttnContext, layer: int, fuse: bool,
                couple_hidden: HiddenCoupling | None = None) -> Groups:
        ...

    @staticmethod
    @abstractmethod
    def param_counts(cfg: ModelConfig) -> dict[str, int]:
        """Per-layer parameter counts: ``total``, ``active`` (primary row), ``active_branch``,
        ``coupling_hidden`` (width of the branch's ``b`` vector) and, for routed FFNs,
        ``per_expert``."""
        ...


def build_ffn(cfg: ModelConfig) -> FFN:
    if cfg.ffn not in FFN_TYPES:
        # FFN types in other modules register themselves on import.
        import archlab.model.moe  # noqa: F401
    return FFN_TYPES[cfg.ffn](cfg)


def ffn_param_counts(cfg: ModelConfig) -> dict[str, int]:
    if cfg.ffn not in FFN_TYPES:
        import archlab.model.moe  # noqa: F401
    return FFN_TYPES[cfg.ffn].param_counts(cfg)


@register_ffn("swiglu")
class SwiGLU(FFN):
    """``W_down (silu(W_gate x) * W_up x)``; the gated product is the hidden activation ``u``.
    ``w_gate_up`` stacks ``W_gate`` over ``W_up``."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or cfg.hidden
        self.coupling_hidden = hidden
        self.hidden = hidden
        self.w_gate_up = nn.Linear(cfg.d_model, 2 * hidden, bias=False)  # [gate; up]: one matmul
        self.w_down = nn.Linear(hidden, cfg.d_model, bias=False)

    def hidden_act(self, hs: Groups, fuse: bool) -> Groups:
        out = []
        for gu in project(self.w_gate_up, hs, fuse):
            if gu is None:
                out.append(None)
                continue
            g, u = gu.split(self.hidden, dim=-1)
            out.append(F.silu(g) * u)
        return out

    def forward(self, hs: Groups, ctx: AttnContext, layer: int, fuse: bool,
                couple_hidden: HiddenCoupling | None = None) -> Groups:
        us = self.hidden_act(hs, fuse)
        if hs[0] is not None and ctx.stash is not None:
            ctx.stash.put(layer, "u", us[0])
        if couple_hidden is not None and len(us) > 1 and us[1] is not None:
            src = us[0] if us[0] is not None else ctx.stash.get(layer, "u")
            us[1] = couple_hidden(src, us[1])
        return project(self.w_down, us, fuse)

    @staticmethod
    def param_counts(cfg: ModelConfig) -> dict[str, int]:
        n = 3 * cfg.d_model * cfg.hidden
        return {"total": n, "active": n, "active_branch": n, "coupling_hidden": cfg.hidden}
