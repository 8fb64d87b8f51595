"""The ``residual`` slot: how each sublayer's input is formed from the outputs before it.

The model loop is written against this interface only, so attention residuals and delta
conversion (``archlab.model.variants.attnres``) plug in without touching the model:

    state = stream.start(embedding, ctx)       # per run over the layers
    h = stream.read(state, site)               # input of sublayer ``site`` (0 .. 2L-1)
    state = stream.write(state, site, out)     # after the sublayer produced ``out``
    x = stream.final(state)                    # before the final norm
    state = stream.resize(state, width, seen)  # between layers of different widths (width slot)

Sites are numbered attention-then-MLP: layer ``l`` has sites ``2l`` and ``2l + 1``. A stream kind
is a module built as ``cls(cfg, specs)`` with those four methods, ``init_parameters(init)`` and
a ``cost(cfg, specs)`` classmethod. Routing is per position, so cached decoding needs nothing
beyond the KV cache: a state lives for one run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from archlab.model.core.context import Context
from archlab.model.core.cost import Cost

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.init import Init
    from archlab.model.core.spec import LayerSpec


def resize_stream(x: Tensor, width: int, seen: list[Tensor]) -> Tensor:
    """The parameter-free resize of a residual stream ``x`` [..., w] to ``width`` (><former):
    shrinking keeps the first ``width`` coordinates; growing refills the new ones from the most
    recent earlier state that was wide enough, else zeros. ``seen`` collects the states at each
    resize of this run (the caller keeps it for the run)."""
    seen.append(x)
    w = x.shape[-1]
    if width <= w:
        return x[..., :width]
    src = next((s for s in reversed(seen) if s.shape[-1] >= width), None)
    fill = src[..., w:width] if src is not None else x.new_zeros(*x.shape[:-1], width - w)
    return torch.cat([x, fill.to(x.dtype)], dim=-1)


class StandardResidual(nn.Module):
    """``x <- x + f(x)``: the pre-norm baseline."""

    def __init__(self, cfg: "ModelConfig", specs: "list[LayerSpec]"):
        super().__init__()

    def init_parameters(self, init: "Init") -> None:
        pass

    def start(self, x0: Tensor, ctx: Context) -> Tensor:
        return x0

    def read(self, state: Tensor, site: int) -> Tensor:
        return state

    def write(self, state: Tensor, site: int, out: Tensor) -> Tensor:
        return state + out

    def final(self, state: Tensor) -> Tensor:
        return state

    def resize(self, state: Tensor, width: int, seen: list[Tensor]) -> Tensor:
        return resize_stream(state, width, seen)

    @classmethod
    def cost(cls, cfg: "ModelConfig", specs: "list[LayerSpec]") -> Cost:
        return Cost()  # the add is not counted (elementwise)
