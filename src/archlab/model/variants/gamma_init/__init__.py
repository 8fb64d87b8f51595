"""gamma-init (spec section 3, arXiv 2606.17945): the ``gamma`` kind of the ``init`` slot.

``model.init: gamma`` with options ``model.gamma_init.*``: every weight drawn from
``N(0, d_in^(-2 gamma))`` where ``d_in`` is the fan-in the component states. ``gamma = 0.5`` is the
usual fan-in scale; larger is smaller. Code in ``module``. The paper's companion settings: RMSNorm
eps 1e-12 (the core option ``model.norm_eps``) and attention sinks (the core option
``model.attn_sinks``), both set in ``configs/zoo/gamma_init.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass

from archlab.model.registry import Variant, register
from archlab.typed import check


@dataclass
class GammaInitConfig:
    gamma: float = 1.0  # std = fan_in ** -gamma

    def validate(self, model) -> None:
        check(self.gamma >= 0, "model.gamma_init.gamma", f"must be >= 0, got {self.gamma}")


register(Variant("init", "gamma", "archlab.model.variants.gamma_init.module:GammaInit", options=GammaInitConfig,
                 section="gamma_init", doc="every weight ~ N(0, fan_in^(-2 gamma))"))
