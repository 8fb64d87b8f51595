"""The model: one pre-norm decoder core (``core``) with slots that variants plug into
(``registry``, ``variants``), its config (``config``) and its accounting (``accounting``).

Importing this package imports no torch; ``build_model`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.decoder import Transformer


def build_model(cfg: "ModelConfig") -> "Transformer":
    from archlab.model.core.decoder import Transformer

    return Transformer(cfg)


def __getattr__(name: str):
    if name in ("Transformer", "ModelOutput"):
        from archlab.model.core import decoder

        return getattr(decoder, name)
    raise AttributeError(name)


__all__ = ["ModelOutput", "Transformer", "build_model"]
