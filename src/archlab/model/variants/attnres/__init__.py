"""Attention residuals over depth (spec section 2): the ``attnres`` (AttnRes, Block AttnRes, MHAR)
and ``delta`` (identity-preserving conversion) kinds of the ``residual`` slot.

Chosen by ``model.residual.kind``; both read their options from ``model.residual.*``. The code
is in ``module``; the routing kernels in ``archlab.kernels``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from archlab.model.core.spec import n_visits
from archlab.model.registry import Variant, register
from archlab.typed import check


@dataclass
class ResidualConfig:
    """How a sublayer's input is formed from earlier outputs."""

    kind: str = "standard"  # a kind of the residual slot: standard, attnres, delta
    blocks: int = 0  # attnres: number of blocks over the 2L sublayers; 0 = full (one per sublayer)
    heads: int = 1  # attnres/delta: routing heads H (1 = AttnRes, >1 = MHAR)
    delta_groups: int = 0  # delta: groups of sublayers whose outputs form one delta source; 0 = L
    impl: Literal["auto", "reference", "compile", "triton"] = "auto"
    # dtype the depth sources are stored and routed in. auto: the autocast dtype when autocast is
    # on (bf16 on CUDA: the sublayer outputs are bf16 there anyway, so only the embedding source is
    # rounded, and the routing moves half the bytes), else the embedding's.
    source_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # dtype of the buffer in which the backward sums each source's gradient over its reads
    # (impl compile/triton). auto: the sources' dtype (the kernel adds in fp32 and rounds once per
    # read, as autograd's own bf16 sums did). float32, as the MHAR paper does, rounds the sum once
    # but made a 124m step take 28% longer on an H200 (docs/benchmarks.md).
    grad_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # How the Triton routing's backward forms each source's gradient. accumulate: every read adds
    # its share to a gradient buffer (read the source, read and write the sum: three rows per
    # read and source). deferred: every read keeps its upstream gradient and per-head scalars, and
    # each source's gradient is assembled once when its last read's backward is done (two rows per
    # read and source, more memory: docs/benchmarks.md). Only the Triton path has it; where
    # impl auto resolves to another (CPU), accumulate runs.
    backward: Literal["accumulate", "deferred"] = "accumulate"

    def validate(self, model) -> None:
        check(self.heads > 0 and model.d_model % self.heads == 0, "model.residual.heads",
              f"must divide d_model={model.d_model}, got {self.heads}")
        # Sites are per visit of the layer schedule (two each), not per layer: a looped layer's
        # runs are different sites (n_visits = n_layers for the sequential schedule).
        sites = 2 * n_visits(model)
        check(0 <= self.blocks <= sites, "model.residual.blocks",
              f"must be in 0..{sites} (0 = full AttnRes), got {self.blocks}")
        check(0 <= self.delta_groups <= sites, "model.residual.delta_groups",
              f"must be in 0..{sites}, got {self.delta_groups}")
        check(self.backward == "accumulate" or self.impl in ("auto", "triton"), "model.residual.backward",
              f"'deferred' is a Triton backward: it needs impl auto or triton, got impl {self.impl!r}")


_MODULE = "archlab.model.variants.attnres.module"
register(Variant("residual", "attnres", f"{_MODULE}:AttnResResidual", options=ResidualConfig, section="residual",
                 doc="AttnRes / Block AttnRes / MHAR: softmax routing over depth (spec 2)"))
register(Variant("residual", "delta", f"{_MODULE}:DeltaResidual", options=ResidualConfig, section="residual",
                 doc="delta AttnRes: identity-preserving routed input added to a standard stream"))
