"""Layer dropout (spec section 3, arXiv 2609.05275): the ``layer_dropout`` kind of the ``schedule``
slot.

``model.schedule: layer_dropout`` with options ``model.layer_dropout.*``. In training, each
sequence drops each visit (a whole block: attention and FFN) with a probability that rises
linearly with depth, from 0 at the first visit to ``p_max`` at the last, and decays linearly to 0
over the run (``decay``); a kept block's update is scaled by ``1/(1-p)``. Evaluation and cached
decoding run every visit unscaled. The visits themselves are another schedule kind's
(``schedule``: ``sequential`` or ``looped``), so dropout composes with loops. Dropped rows are
not computed: the decoder runs a block on the kept rows only (``Transformer.run``).

An optional early-exit loss (``exit_loss``, ``exits``) trains chosen exits through the shared
final norm and head as well (LayerSkip's recipe, arXiv 2404.16710, pairs it with layer dropout):
the paper this kind follows names early exit and self-speculative drafting as uses of dropout
but trains no exit; without an exit loss the shallow exits of a short run draft poorly
(``docs/benchmarks.md``, self-speculative decoding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from archlab.model import registry
from archlab.model.registry import Variant, register
from archlab.typed import check


@dataclass
class LayerDropoutConfig:
    p_max: float = 0.2  # drop probability of the last visit at the start of training
    decay: bool = True  # the probabilities fall linearly to 0 over the run (false: constant)
    #: the schedule kind whose visits are dropped (its own options apply: ``model.looped.*``)
    schedule: str = "sequential"
    #: weight of the early-exit loss added in training: ``exit_loss`` times the mean next-token
    #: loss read out after each of ``exits`` (0: none; evaluation reports the last exit's alone)
    exit_loss: float = 0.0
    #: the exits that loss trains, as numbers of visits run (``archlab probe exits`` lists them);
    #: empty: every exit before the last
    exits: list[int] = field(default_factory=list)

    #: added after layer-dropout runs were recorded; at their defaults (no exit loss) they are left
    #: out of the config, so those runs keep their ids (``ModelConfig.to_dict``)
    LATER_FIELDS = ("exit_loss", "exits")

    def validate(self, model) -> None:
        check(math.isfinite(self.p_max) and 0 <= self.p_max < 1, "model.layer_dropout.p_max",
              f"must be a probability in [0, 1), got {self.p_max}")
        kinds = registry.variants("schedule")
        check(self.schedule in kinds and self.schedule != "layer_dropout", "model.layer_dropout.schedule",
              f"must name another schedule kind ({', '.join(k for k in sorted(kinds) if k != 'layer_dropout')}), "
              f"got {self.schedule!r}")
        base = kinds[self.schedule]
        if base.section_name is not None and hasattr(getattr(model, base.section_name), "validate"):
            getattr(model, base.section_name).validate(model)
        residual = getattr(getattr(model, "residual", None), "kind", "standard")
        check(residual == "standard", "model.residual.kind",
              f"layer dropout adds a kept block's scaled update x + (Attn + FFN)/(1-p) to the hidden state, "
              f"which only the standard stream has; {residual!r} cannot be combined with it")
        check(math.isfinite(self.exit_loss) and self.exit_loss >= 0, "model.layer_dropout.exit_loss",
              f"must be a finite weight >= 0, got {self.exit_loss}")
        if self.exit_loss > 0 or self.exits:
            points = training_exit_points(model)
            check(all(isinstance(e, int) and not isinstance(e, bool) and e in points for e in self.exits),
                  "model.layer_dropout.exits", f"an early-exit loss may follow visits {points} (not the last, "
                  f"whose loss is the model's own), got {self.exits}")
            check(len(set(self.exits)) == len(self.exits), "model.layer_dropout.exits",
                  f"names an exit twice: {self.exits}")
            check(bool(points), "model.layer_dropout.exit_loss", "the model has no exit before its last visit")
            check(model.objective == "autoregressive" and registry.kind_of(model, "rows") == "primary",
                  "model.layer_dropout.exit_loss", f"the early-exit loss reads next-token predictions of the "
                  f"plain rows; rows kind {registry.kind_of(model, 'rows')!r} / objective {model.objective!r} "
                  f"cannot be combined with it")
        check(registry.followers(model) == 0, "model.schedule",
              "layer dropout draws per row of a run; the decode branch's follower rows run apart from their "
              "primary rows and would drop other blocks: turn one of them off")


def training_exit_points(model) -> list[int]:
    """The exits an early-exit loss may train: numbers of visits after which the state has the
    final norm's width (``Transformer.exit_points``), the last visit excluded."""
    from archlab.model.core.spec import layer_specs, layer_visits

    specs, visits = layer_specs(model), layer_visits(model)
    return [n for n in range(1, len(visits)) if specs[visits[n - 1]].d == specs[visits[-1]].d]


def trained_exits(model) -> list[int]:
    """The exits the early-exit loss trains: ``exits``, or every one before the last."""
    return list(model.layer_dropout.exits) or training_exit_points(model)


register(Variant("schedule", "layer_dropout", "archlab.model.variants.layer_dropout.schedule:LayerDropout",
                 options=LayerDropoutConfig, section="layer_dropout",
                 doc="in training, each sequence drops whole blocks, more often deeper (stochastic depth)"))
