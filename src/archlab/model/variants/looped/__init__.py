"""Looped Transformer and DiscoLoop (spec section 3, arXiv 2607.00341): the ``looped`` kind of the
``schedule`` slot.

``model.schedule: looped`` with options ``model.looped.*``: the first ``prelude`` layers run once,
the middle layers ``loops`` times with shared weights, the last ``coda`` layers once. The core
keys the KV cache, the residual sites and the costs by visit, so a loop needs nothing but its
visit list (``schedule``). ``channel: disco`` adds DiscoLoop's discrete channel between loop
iterations, ``h <- h + alpha RMSNorm(softmax(W h / tau) W)`` with ``W`` the tied embedding table
(``module``). The schedule and its costs are torch-free (config checks and ``archlab info`` import
no torch); the channel's module is built only when a model is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from archlab.model.registry import Variant, register
from archlab.typed import check


@dataclass
class LoopedConfig:
    loops: int = 2  # K: how many times the middle layers run
    prelude: int = 0  # first layers that run once, before the loop
    coda: int = 0  # last layers that run once, after the loop
    #: what happens to the hidden state between loop iterations: nothing, or DiscoLoop's channel
    channel: Literal["none", "disco"] = "none"
    tau: float = 1.0  # softmax temperature of the channel's distribution over the vocabulary
    alpha: float = 1.0  # the channel's weight (fixed), or its value at initialisation (learned)
    #: fixed: ``alpha`` everywhere; learned: ``2 alpha sigmoid(w . RMSNorm(h) + b)`` per token, w = b = 0 at init
    alpha_mode: Literal["fixed", "learned"] = "fixed"
    #: training-free realignment: the channel runs only outside training (evaluation, cached
    #: decoding), so the model trains as a plain loop and is read out with the channel
    realign: bool = False
    #: tokens per chunk of the channel's vocabulary softmax, each recomputed in backward instead of
    #: keeping its [tokens, vocab] probabilities (0: all tokens at once, nothing recomputed)
    chunk_tokens: int = 0

    def validate(self, model) -> None:
        n = model.n_layers
        check(self.loops >= 1, "model.looped.loops", f"must be at least 1, got {self.loops}")
        check(self.prelude >= 0, "model.looped.prelude", f"must be at least 0, got {self.prelude}")
        check(self.coda >= 0, "model.looped.coda", f"must be at least 0, got {self.coda}")
        check(self.prelude + self.coda < n, "model.looped.prelude",
              f"prelude {self.prelude} + coda {self.coda} leave no layer to loop of model.n_layers={n}")
        check(self.chunk_tokens >= 0, "model.looped.chunk_tokens", f"must be at least 0, got {self.chunk_tokens}")
        if self.channel == "none":
            check(not self.realign, "model.looped.realign", "realigns with the channel: set model.looped.channel=disco")
            return
        check(self.loops >= 2, "model.looped.channel",
              f"disco acts between loop iterations; loops={self.loops} has none (set model.looped.loops >= 2)")
        check(math.isfinite(self.tau) and self.tau > 0, "model.looped.tau",
              f"must be a positive number, got {self.tau}")
        check(math.isfinite(self.alpha) and self.alpha >= 0, "model.looped.alpha",
              f"must be a finite number >= 0, got {self.alpha}")
        check(model.tie_embeddings, "model.tie_embeddings",
              "DiscoLoop's channel mixes rows of the tied embedding table W (the paper's): set it true")
        residual = getattr(getattr(model, "residual", None), "kind", "standard")
        check(residual == "standard", "model.residual.kind",
              f"DiscoLoop's channel rewrites the hidden state between loops, which only the standard "
              f"stream is; {residual!r} routes over a depth history it would bypass")
        check(not (self.realign and self.alpha_mode == "learned"), "model.looped.alpha_mode",
              "learned gates would never train under realign (the channel is off in training): use fixed")


register(Variant("schedule", "looped", "archlab.model.variants.looped.schedule:Looped", options=LoopedConfig,
                 section="looped",
                 doc="the middle layers run K times with shared weights; optional DiscoLoop channel between loops"))
