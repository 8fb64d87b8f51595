"""Routed mixture-of-experts FFN (spec section 1, "Mixture-of-Experts variant"): ``model.ffn: moe``
with options ``model.moe.*``; usable with or without the decode branch. Code in ``module``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from archlab.model import registry
from archlab.model.registry import Variant, register
from archlab.typed import check


@dataclass
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2  # primary fan-out k1
    branch_top_k: int = 0  # follower (branch) fan-out k2 (0 = same as top_k)
    expert_hidden: int = 0  # 0 = the dense SwiGLU hidden size divided by top_k, multiple of 64
    shared_expert: bool = False
    aux_loss_coef: float = 0.01
    branch_routing: Literal["replay", "independent"] = "replay"

    def validate(self, model) -> None:
        check(self.n_experts >= 1, "model.moe.n_experts", "must be >= 1")
        check(1 <= self.top_k <= self.n_experts, "model.moe.top_k",
              f"must be in 1..n_experts={self.n_experts}, got {self.top_k}")
        k2 = self.branch_top_k or self.top_k
        check(1 <= k2 <= self.n_experts, "model.moe.branch_top_k",
              f"must be in 0..n_experts={self.n_experts}, got {self.branch_top_k}")
        check(self.expert_hidden >= 0, "model.moe.expert_hidden", "must be >= 0 (0 = automatic)")
        check(self.aux_loss_coef >= 0, "model.moe.aux_loss_coef", "must be >= 0")
        if registry.followers(model) and self.branch_routing == "replay":
            check(k2 <= self.top_k, "model.moe.branch_top_k",
                  f"router replay picks the branch's experts among the primary's {self.top_k}; "
                  f"branch_top_k={k2} needs moe.branch_routing=independent")


register(Variant("ffn", "moe", "archlab.model.variants.moe.module:MoE", options=MoEConfig, section="moe",
                 doc="top-k routed SwiGLU experts, optional shared expert, router replay for followers"))
