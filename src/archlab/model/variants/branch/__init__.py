"""Decode-Branch Transformer (spec section 1): the ``branch`` kind of the ``rows`` slot.

Switched on by ``model.branch.enabled``; its options are ``model.branch.*``. The code is in
``module`` (the rows, their passes and coupling) and ``readout`` (the mixture).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from archlab.model.registry import Variant, register
from archlab.typed import check


@dataclass
class BranchConfig:
    enabled: bool = False
    n_branches: int = 1
    coupling: bool = True  # the a/b/c primary-to-branch coupling vectors
    readout: Literal["mixture", "branch"] = "mixture"
    detach_alpha: bool = False  # uncertain in the paper: whether alpha is a constant in backward
    alpha_min: float = 0.5
    alpha_max: float = 1.0

    def followers(self) -> int:
        return self.n_branches if self.enabled else 0

    def validate(self, model) -> None:
        check(self.n_branches >= 1, "model.branch.n_branches", "must be >= 1")
        check(0.0 <= self.alpha_min <= self.alpha_max <= 1.0, "model.branch.alpha_min",
              "need 0 <= alpha_min <= alpha_max <= 1")


register(Variant("rows", "branch", "archlab.model.variants.branch.module:BranchRows", options=BranchConfig,
                 section="branch", active=lambda cfg: bool(cfg.branch.enabled),
                 doc="decode branch: follower rows sharing every weight but the embedding (spec 1)"))
