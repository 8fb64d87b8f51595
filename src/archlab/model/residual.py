"""Residual streams: how each sublayer's input is formed from the outputs before it.

The model loop is written against this interface only, so attention residuals (``attnres``) and
delta conversion plug in without touching the model:

    state = stream.start(embedding)            # per row group
    h = stream.read(state, site)               # input of sublayer ``site`` (0 .. 2L-1)
    state = stream.write(state, site, out)     # after the sublayer produced ``out``
    x = stream.final(state)                    # before the final norm

Sites are numbered attention-then-MLP: layer ``l`` has sites ``2l`` and ``2l + 1``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import Tensor, nn

from archlab.config import ModelConfig

RESIDUAL_TYPES: dict[str, type["ResidualStream"]] = {}


def register_residual(name: str):
    def deco(cls):
        RESIDUAL_TYPES[name] = cls
        return cls
    return deco


class ResidualStream(nn.Module, ABC):
    @abstractmethod
    def start(self, x0: Tensor) -> Any:
        ...

    @abstractmethod
    def read(self, state: Any, site: int) -> Tensor:
        ...

    @abstractmethod
    def write(self, state: Any, site: int, out: Tensor) -> Any:
        ...

    @abstractmethod
    def final(self, state: Any) -> Tensor:
        ...

    @staticmethod
    def param_count(cfg: ModelConfig) -> int:
        return 0

    @staticmethod
    def flops_per_token(cfg: ModelConfig) -> int:
        """Forward FLOPs per token spent forming sublayer inputs (0 for the plain sum)."""
        return 0


@register_residual("standard")
class StandardResidual(ResidualStream):
    """``x <- x + f(x)``: the pre-norm baseline."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()

    def start(self, x0: Tensor) -> Tensor:
        return x0

    def read(self, state: Tensor, site: int) -> Tensor:
        return state

    def write(self, state: Tensor, site: int, out: Tensor) -> Tensor:
        return state + out

    def final(self, state: Tensor) -> Tensor:
        return state


def _load_types(kind: str) -> None:
    if kind not in RESIDUAL_TYPES:
        import archlab.model.attnres  # noqa: F401  (registers attnres and delta)


def build_residual(cfg: ModelConfig) -> ResidualStream:
    _load_types(cfg.residual.kind)
    return RESIDUAL_TYPES[cfg.residual.kind](cfg)


def residual_type(cfg: ModelConfig) -> type[ResidualStream]:
    _load_types(cfg.residual.kind)
    return RESIDUAL_TYPES[cfg.residual.kind]
