"""Hidden Decoding (spec section 3, arXiv 2607.08186): the ``hidden`` kind of the ``rows`` slot.

Switched on by ``model.hidden_decoding.enabled``; its options are ``model.hidden_decoding.*``
(the section is not called ``hidden``: ``ModelConfig.hidden`` is already the FFN hidden size).
The code is in ``module`` (the streams, their attention and their passes).
"""

from __future__ import annotations

from dataclasses import dataclass

from archlab.model.registry import Variant, register
from archlab.typed import check


@dataclass
class HiddenDecodingConfig:
    enabled: bool = False
    #: rows per token: streams 0..n-2 are hidden (context only), stream n-1 is scored
    streams: int = 2
    #: layers whose attention runs across the streams; None: the middle layer alone
    #: (``n_layers // 2``), which keeps a converted checkpoint's function exactly (docs)
    mix_layers: list[int] | None = None

    def followers(self) -> int:
        # Streams are full rows (keys/values of their own), not the accounting's follower rows:
        # the rows kind restates every part's per-token work itself (``per_token_parts``).
        return 0

    def mixing(self, n_layers: int) -> frozenset[int]:
        """The layers that attend across streams."""
        return frozenset([n_layers // 2] if self.mix_layers is None else self.mix_layers)

    def validate(self, model) -> None:
        check(isinstance(self.streams, int) and 1 <= self.streams <= 64, "model.hidden_decoding.streams",
              f"must be an integer in 1..64, got {self.streams!r}")
        if self.mix_layers is not None:
            bad = [layer for layer in self.mix_layers if not (isinstance(layer, int) and 0 <= layer < model.n_layers)]
            check(not bad, "model.hidden_decoding.mix_layers",
                  f"{bad} are not layer indices in 0..{model.n_layers - 1}")
            check(len(set(self.mix_layers)) == len(self.mix_layers), "model.hidden_decoding.mix_layers",
                  f"lists a layer twice: {self.mix_layers}")


register(Variant("rows", "hidden", "archlab.model.variants.hidden.module:HiddenRows", options=HiddenDecodingConfig,
                 section="hidden_decoding", active=lambda cfg: bool(cfg.hidden_decoding.enabled),
                 # layer dropout drops single rows, which would split a token's streams apart
                 excludes=("schedule:layer_dropout",),
                 doc="Hidden Decoding: n embedded streams per token, interleaved; the last scored (spec 3)"))
