"""gamma-init: ``w ~ N(0, fan_in^(-2 gamma))`` for every weight, whatever its role.

The fan-in is the one each component states when it draws (``Init.weight(w, fan_in, role)``):
the input width of a linear map (``w.shape[-1]`` for ``[out, in]`` weights; MoE experts state
theirs), ``d_model`` for an embedding table (a row is ``d_model`` wide; ``Init.embedding``) and
for the unembedding. No role is treated differently: output projections get no ``1/sqrt(2L)``
depth factor. Parameters that are not drawn (norm gains, AttnRes queries, decode-branch coupling
vectors, all initialised to constants by their components) are untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from archlab.model.core.init import Init

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig


class GammaInit(Init):
    def __init__(self, cfg: "ModelConfig") -> None:
        self.gamma = cfg.gamma_init.gamma

    def std(self, fan_in: int) -> float:
        return float(fan_in) ** -self.gamma

    def weight(self, w: Tensor, fan_in: int, role: str) -> None:
        with torch.no_grad():
            nn.init.normal_(w, 0.0, self.std(fan_in))
