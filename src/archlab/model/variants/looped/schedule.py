"""The ``looped`` schedule kind: its visits, where the channel acts, and the channel's cost.

Torch-free: the config check and ``archlab info`` read the visits and costs without torch; the
channel's module (``module.DiscreteChannel``) is imported only when a model is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from archlab.model.core.cost import Cost
from archlab.model.core.spec import base_width

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.spec import LayerSpec


class Looped:
    """``prelude`` layers once, the middle layers ``loops`` times, ``coda`` layers once.

    With ``n_layers=6, prelude=1, coda=1, loops=2`` the visits are ``[0, 1, 2, 3, 4, 1, 2, 3, 4,
    5]``; the channel (if any) transforms the hidden state before visit 5, the start of the second
    iteration (``loop_starts``)."""

    def __init__(self, cfg: "ModelConfig") -> None:
        self.cfg = cfg
        o, n = cfg.looped, cfg.n_layers
        # Clamped so that out-of-range options reach LoopedConfig.validate's message, not a list
        # of layer indices the core refuses first.
        first, last = min(max(o.prelude, 0), n), max(n - max(o.coda, 0), 0)
        self.prelude = list(range(first))
        self.middle = list(range(first, max(first, last)))
        self.coda = list(range(max(first, last), n))
        self.loops = max(o.loops, 1)

    def visits(self) -> list[int]:
        return self.prelude + self.middle * self.loops + self.coda

    def loop_starts(self) -> list[int]:
        """The visits that begin loop iterations 2..K (the channel runs on their input)."""
        return [len(self.prelude) + k * len(self.middle) for k in range(1, self.loops)]

    def between(self) -> Any:
        """The module that transforms the residual state before some visits, or None (no channel)."""
        if self.cfg.looped.channel == "none":
            return None
        from archlab.model.variants.looped.module import DiscreteChannel

        return DiscreteChannel(self.cfg, self.loop_starts())

    @classmethod
    def cost(cls, cfg: "ModelConfig", specs: "list[LayerSpec]") -> Cost:
        """The channel's cost per token, all its boundaries together: ``W h`` and ``softmax . W``
        are two ``V x d`` products (``4 V d`` FLOPs; the softmax itself is not counted, by the
        accounting's convention), plus the learned gate's ``d``-vector; a decode step reads the
        table once per boundary. Realigned, training never runs it."""
        o = cfg.looped
        if o.channel == "none":
            return Cost()
        boundaries = len(cls(cfg).loop_starts())
        d, vocab = base_width(cfg), cfg.vocab_size
        gate = d + 1 if o.alpha_mode == "learned" else 0
        return Cost(params=gate, flops=boundaries * (4 * vocab * d + (2 * d if gate else 0)),
                    decode_params=lambda batch: boundaries * (vocab * d + gate), trained=not o.realign)
