"""><former, variable width (arXiv 2606.18246; spec section 3): the ``variable`` kind of the ``width``
slot (``model.width: variable``, options ``model.variable_width.*``). Code in ``module``."""

from __future__ import annotations

from dataclasses import dataclass

from archlab.model import registry
from archlab.model.registry import Variant, register
from archlab.typed import check


@dataclass
class VariableWidthConfig:
    #: narrowest width / base width (uncertain in the spec: "narrow middle"; 0.5 by default)
    bottleneck: float = 0.5
    #: where the bottleneck sits, as a fraction of depth (the spec: "about 3/4")
    bottleneck_at: float = 0.75
    multiple_of: int = 32  # widths are rounded to multiples of this
    #: head width of every layer: heads = width / head_dim (the spec: "heads at w_l/16");
    #: 0 keeps the config's head_dim (heads then scale with the width)
    head_dim: int = 16
    #: the base width (embedding, first and last layers); 0 = solved so that the model has the
    #: parameters of the uniform model of width d_model (within one ``multiple_of`` step)
    base_width: int = 0

    def validate(self, model) -> None:
        check(0 < self.bottleneck <= 1, "model.variable_width.bottleneck", f"must be in (0, 1], got {self.bottleneck}")
        check(0 < self.bottleneck_at < 1, "model.variable_width.bottleneck_at",
              f"must be in (0, 1), got {self.bottleneck_at}")
        check(self.multiple_of >= 2 and self.multiple_of % 2 == 0, "model.variable_width.multiple_of",
              f"must be even and >= 2, got {self.multiple_of}")
        check(self.head_dim >= 0 and self.head_dim % 2 == 0, "model.variable_width.head_dim",
              f"must be 0 or an even number (RoPE), got {self.head_dim}")
        hd = self.head_dim or model.dim_per_head
        check(self.multiple_of % hd == 0, "model.variable_width.multiple_of",
              f"{self.multiple_of} must be a multiple of the head width {hd}, so every width splits into heads")
        check(self.base_width >= 0 and self.base_width % self.multiple_of == 0, "model.variable_width.base_width",
              f"must be 0 (solved) or a multiple of {self.multiple_of}, got {self.base_width}")
        check(model.n_layers >= 3, "model.n_layers", "width 'variable' needs at least 3 layers (shrink, then grow)")
        check(model.layer_heads is None, "model.layer_heads", "cannot be combined with width 'variable' (it sets heads)")
        if registry.kind_of(model, "residual") != "standard":
            heads = model.residual.heads
            check(self.multiple_of % heads == 0, "model.residual.heads",
                  f"{heads} routing heads must divide every width (multiples of {self.multiple_of})")


register(Variant("width", "variable", "archlab.model.variants.width.module:VariableWidth",
                 options=VariableWidthConfig, section="variable_width", excludes=("heads:prism",),
                 doc="><former: wide early and late, narrow at 3/4 depth; parameter-free residual resizing"))
