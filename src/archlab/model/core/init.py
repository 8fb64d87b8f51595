"""The ``init`` slot: how every weight is drawn.

A component initialises its own parameters in ``init_parameters(init)`` and says what each weight
*is* (its role and fan-in); the init kind decides the distribution. No parameter is recognised
by its name. Roles:

``in``         a projection into a sublayer's computation (attention q/k/v, FFN input, router)
``out``        a sublayer's output projection, which adds to the residual stream
``embedding``  a token embedding table
``head``       the unembedding (for tied embeddings this draw is the shared table's final value)

The core kind ``normal`` is GPT-2's: Normal(0, ``init_std``), and ``init_std / sqrt(2L)`` for
``out`` weights so the residual stream's variance does not grow with depth.

Draw order matters for reproducibility: the model initialises its components in a fixed order
(embeddings, rows, residual, layers in order, head), each component its weights in order.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig


class Init(ABC):
    """Base of the init kinds: ``weight`` draws one tensor; ``linear`` is a weight [out, in]."""

    @abstractmethod
    def weight(self, w: Tensor, fan_in: int, role: str) -> None:
        """Draw ``w`` in place for a weight of ``role`` whose rows read ``fan_in`` inputs."""

    def linear(self, w: Tensor, role: str) -> None:
        self.weight(w, w.shape[-1], role)

    def embedding(self, w: Tensor) -> None:
        self.weight(w, w.shape[-1], "embedding")


class NormalInit(Init):
    def __init__(self, cfg: "ModelConfig") -> None:
        self.std = cfg.init_std
        self.out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)

    def weight(self, w: Tensor, fan_in: int, role: str) -> None:
        with torch.no_grad():
            nn.init.normal_(w, 0.0, self.out_std if role == "out" else self.std)
