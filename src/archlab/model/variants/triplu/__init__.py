"""TriPLU (spec section 3, arXiv 2608.20360): the ``triplu`` kind of the ``ffn`` slot.

``model.ffn: triplu`` with options ``model.triplu.*``: ``W_o N((W_1 x) * (W_2 x) * (W_3 x))``, a
product of ``degree`` projections with no activation function, ``N`` an optional RMSNorm on the
product, the hidden width solved so that the FFN's parameters match SwiGLU's. Code in ``module``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from archlab.model.registry import Variant, register
from archlab.typed import check


@dataclass
class TriPLUConfig:
    degree: Literal[2, 3, 4] = 3  # number of multiplied projections (2 and 4 are the paper's controls)
    norm: bool = True  # RMSNorm (with a learnable gain, eps model.norm_eps) on the product
    hidden: int = 0  # 0 = solved to match SwiGLU's parameters (module.solve_hidden)
    #: hidden rounded to the nearest multiple of this; 0 = the largest of 64, 32, .., 1 that keeps
    #: the parameters within ``tolerance`` of SwiGLU's
    multiple_of: int = 0
    tolerance: float = 0.01
    #: the input projections W_1..W_degree are drawn by the init kind and multiplied by this
    #: (the paper's "small init"; W_o is drawn by the init kind unscaled)
    init_scale: float = 0.5

    def validate(self, model) -> None:
        check(self.hidden >= 0, "model.triplu.hidden", "must be >= 0 (0 = matched to SwiGLU)")
        check(self.multiple_of >= 0, "model.triplu.multiple_of", "must be >= 0 (0 = automatic)")
        check(0 < self.tolerance < 1, "model.triplu.tolerance", f"must be in (0, 1), got {self.tolerance}")
        check(self.init_scale > 0, "model.triplu.init_scale", f"must be positive, got {self.init_scale}")


register(Variant("ffn", "triplu", "archlab.model.variants.triplu.module:TriPLU", options=TriPLUConfig,
                 section="triplu", doc="W_o N(prod_k W_k x): degree-3 product FFN, SwiGLU-matched parameters"))
