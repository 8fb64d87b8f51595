"""Prism heads (spec section 3, arXiv 2606.27449): the ``prism`` kind of the ``heads`` slot.

``model.heads: prism`` with options ``model.prism.*``: the head count rises with depth at a fixed
query width, so early layers have few wide heads and late layers many narrow ones, with the
query-per-KV-head group of the base config kept in every layer. Parameters, FLOPs and KV-cache
bytes equal the baseline's. The schedule and its exact rule are in ``module``; like every layer
shape it is torch-free (``archlab info`` reads it without torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from archlab.model import registry
from archlab.model.registry import Variant, register
from archlab.typed import check


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass
class PrismConfig:
    #: head dims of equal depth stages, first stage first; each is clipped to what the query width
    #: and the GQA group allow (``module.head_dim_cap``). Powers of two, non-increasing.
    head_dims: list[int] = field(default_factory=lambda: [256, 128, 64])
    #: an explicit per-layer list of query-head counts instead (non-decreasing, one per layer)
    heads: list[int] | None = None

    def validate(self, model) -> None:
        from archlab.model.variants.prism.module import head_dim_cap, schedule

        check(model.layer_heads is None, "model.layer_heads",
              "is the uniform heads kind's schedule; with model.heads=prism set model.prism.heads instead")
        check(registry.kind_of(model, "width") == "uniform", "model.width",
              f"heads 'prism' cannot be combined with width {registry.kind_of(model, 'width')!r} "
              "(prism keeps the query width fixed; a per-layer width sets its own heads)")
        group = model.n_heads // model.kv_heads
        q_dim = model.n_heads * model.dim_per_head
        cap = head_dim_cap(q_dim, group)
        check(cap >= 2, "model.heads",
              f"prism needs a power-of-two head dim >= 2 dividing q_dim/group = {q_dim}/{group}")
        if self.heads is None:
            check(len(self.head_dims) >= 1, "model.prism.head_dims", "needs at least one stage")
            check(len(self.head_dims) <= model.n_layers, "model.prism.head_dims",
                  f"has {len(self.head_dims)} stages for {model.n_layers} layers")
            for hd in self.head_dims:
                check(_power_of_two(hd) and hd >= 2, "model.prism.head_dims", f"{hd} is not a power of two >= 2")
            check(all(a >= b for a, b in zip(self.head_dims, self.head_dims[1:])), "model.prism.head_dims",
                  f"must not increase with depth (head count rises), got {self.head_dims}")
        else:
            check(len(self.heads) == model.n_layers, "model.prism.heads",
                  f"needs one entry per layer ({model.n_layers}), got {len(self.heads)}")
            for h in self.heads:
                check(h > 0 and q_dim % h == 0 and _power_of_two(q_dim // h) and q_dim // h >= 2,
                      "model.prism.heads", f"{h} heads do not split q_dim={q_dim} into power-of-two head dims >= 2")
                check(h % group == 0, "model.prism.heads",
                      f"{h} heads is not a multiple of the query-per-kv group {group}")
            check(all(a <= b for a, b in zip(self.heads, self.heads[1:])), "model.prism.heads",
                  f"must not decrease with depth, got {self.heads}")
        schedule(model)  # the rule itself cannot fail past these checks


register(Variant("heads", "prism", "archlab.model.variants.prism.module:PrismHeads", options=PrismConfig,
                 section="prism", doc="head count rising with depth at fixed width, power-of-two head dims"))
