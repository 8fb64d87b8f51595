"""LayerRoPE (spec section 3, arXiv 2610.09179): the ``layerrope`` kind of the ``norm`` slot.

``model.norm: layerrope`` with options ``model.layerrope.*``: every per-layer norm gain is replaced
by one shared fp32 gain vector ``g`` rotated per layer: pairs ``(g_2j, g_2j+1)`` as complex
numbers times ``exp(r + i theta_j)``, ``r = a + b u``, ``theta_j = exp(a_rot + b_rot u) base^(-2j/d)``,
``u = log(l + 1)``. Four gain sites per layer (attention/MLP input and output). Code in ``module``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from archlab.model.registry import Variant, register
from archlab.typed import check


@dataclass
class LayerRopeConfig:
    a: float = 0.0  # log-magnitude offset: r = a + b * log(l + 1)
    b: float = -0.5
    a_rot: float = 0.0  # rotation speed: theta_j = exp(a_rot + b_rot * log(l + 1)) * base^(-2j/d)
    b_rot: float = -0.5
    base: float = 100.0
    #: whether a, b, a_rot, b_rot are trained (initialised to the values above) or fixed
    learnable: bool = False
    #: learnable only: one (a, b, a_rot, b_rot) set per site kind (attn_in, attn_out, mlp_in,
    #: mlp_out, final) instead of one set for all
    per_site: bool = True
    #: the sublayer-output gains (attn_out, mlp_out): multiply the output by the rotated gain
    out_sites: bool = True
    #: the final norm: ``rmsnorm`` (its own gain, as the baseline) or ``rotated`` (the shared gain
    #: at depth l = n_layers)
    final: Literal["rmsnorm", "rotated"] = "rmsnorm"

    def validate(self, model) -> None:
        check(model.d_model % 2 == 0, "model.d_model", f"layerrope pairs gain entries: must be even, got {model.d_model}")
        check(self.base > 0, "model.layerrope.base", f"must be positive, got {self.base}")


register(Variant("norm", "layerrope", "archlab.model.variants.layerrope.module:LayerRopeNorms",
                 options=LayerRopeConfig, section="layerrope",
                 doc="one shared fp32 gain, rotated and scaled per layer at four sites (LayerRoPE)"))
