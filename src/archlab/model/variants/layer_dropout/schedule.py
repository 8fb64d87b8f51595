"""The ``layer_dropout`` schedule kind: another kind's visits, and which rows drop each in training.

Torch-free (the config check and ``archlab info`` read the visits and costs without torch); the
per-step draw is ``module.draw_kept``, imported when training first calls ``keep``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from archlab.model import registry
from archlab.model.core.cost import Cost

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.spec import LayerSpec


def depth_probabilities(p_max: float, n_visits: int) -> list[float]:
    """``p_v = p_max v / (n - 1)``: 0 at the first visit, ``p_max`` at the last."""
    if n_visits < 2:
        return [0.0] * n_visits
    return [p_max * v / (n_visits - 1) for v in range(n_visits)]


def mean_drop_rate(p_max: float, progress: float = 0.0, decay: bool = True) -> float:
    """The drop probability averaged over the visits at ``progress``: ``p_max (1 - progress) / 2``
    (the visits' probabilities rise linearly from 0 to ``p_max``); ``p_max / 2`` without decay."""
    return p_max / 2 * ((1.0 - progress) if decay else 1.0)


def _base(cfg: "ModelConfig") -> Any:
    """The kind whose visits are dropped. A name that cannot be one falls back to the core kind
    here: the core lists the visits before the options are checked, and the options' check then
    says what is wrong in one line."""
    kinds = registry.variants("schedule")
    name = cfg.layer_dropout.schedule
    if name not in kinds or name == "layer_dropout":
        name = registry.SLOTS["schedule"].default
    return kinds[name].load()


class LayerDropout:
    """Every visit of ``model.layer_dropout.schedule``; in training, each row drops visit ``v``
    with probability ``p_v (1 - progress)`` (``decay``) or ``p_v``, where ``progress`` is the
    fraction of the run done (``set_training_progress``, called by the trainer each step)."""

    def __init__(self, cfg: "ModelConfig") -> None:
        self.cfg = cfg
        self.options = cfg.layer_dropout
        self.base = _base(cfg)(cfg)
        self.n_visits = len(self.base.visits())
        self.progress = 0.0
        #: visit -> rows that drop it, replacing the draw (``forcing``: tests, FLOP counts)
        self.forced: dict[int, list[int]] | None = None
        #: visit -> the fraction of rows the last training forward ran it on (the realised keep)
        self.kept_fraction: dict[int, float] = {}
        #: the visits (0-based) after which the early-exit loss reads out; set on first use
        self.exit_visits: list[int] | None = None

    def visits(self) -> list[int]:
        return self.base.visits()

    def between(self) -> Any:
        make = getattr(self.base, "between", None)
        return make() if make is not None else None

    # ---- the probabilities ------------------------------------------------------------------------
    def set_training_progress(self, progress: float) -> None:
        self.progress = min(max(float(progress), 0.0), 1.0)

    def drop_probabilities(self, progress: float | None = None) -> list[float]:
        """Each visit's drop probability at ``progress`` (None: the current step's)."""
        progress = self.progress if progress is None else progress
        factor = (1.0 - progress) if self.options.decay else 1.0
        return [p * factor for p in depth_probabilities(self.options.p_max, self.n_visits)]

    @classmethod
    def training_keep(cls, cfg: "ModelConfig") -> list[float]:
        """Each visit's keep probability averaged over the run: ``1 - p_v / 2`` with decay (the
        mean of ``1 - p_v (1 - s)`` over progress ``s`` in [0, 1]), ``1 - p_v`` without. The
        accounting's training FLOPs weight each visit by it: the FLOPs the run actually spends."""
        n = len(_base(cfg)(cfg).visits())
        o = cfg.layer_dropout
        return [1.0 - (p / 2 if o.decay else p) for p in depth_probabilities(o.p_max, n)]

    # ---- the draw ---------------------------------------------------------------------------------
    def keep(self, visit: int, rows: int, device: Any) -> Any:
        """(kept rows [k] on ``device``, the scale ``1/(1-p)`` of their update) or None when no row
        can drop this visit; the decoder runs the block on the kept rows only."""
        from archlab.model.variants.layer_dropout.module import draw_kept

        p = self.drop_probabilities()[visit]
        dropped = None if self.forced is None else self.forced.get(visit, [])
        kept = draw_kept(p, rows, device, dropped)
        self.kept_fraction[visit] = 1.0 if kept is None else kept[0].numel() / rows
        return kept

    @contextmanager
    def forcing(self, dropped: dict[int, list[int]]) -> Iterator[None]:
        """Within the block, visit ``v`` is dropped by exactly the rows ``dropped.get(v, [])``
        (kept updates keep their ``1/(1-p)`` scale)."""
        self.forced = dropped
        try:
            yield
        finally:
            self.forced = None

    # ---- the early-exit loss ------------------------------------------------------------------------
    def exit_loss_hook(self, model: Any, targets: Any, aux: Any) -> "ExitLoss | None":
        """What a training forward calls after each visit (``Transformer.run``'s ``on_exit``) to
        add the early-exit loss to ``aux`` (the run's training-only losses); None when it is off."""
        o = self.options
        if o.exit_loss <= 0:
            return None
        if self.exit_visits is None:  # once: the config's exits do not change
            from archlab.model.variants.layer_dropout import trained_exits

            self.exit_visits = [n - 1 for n in trained_exits(self.cfg)]
        return ExitLoss(model, targets, aux, self.exit_visits, o.exit_loss / len(self.exit_visits))

    # ---- costs ------------------------------------------------------------------------------------
    @classmethod
    def cost(cls, cfg: "ModelConfig", specs: "list[LayerSpec]") -> Cost:
        """The underlying schedule's own cost (DiscoLoop's channel, never dropped)."""
        base = _base(cfg)
        return base.cost(cfg, specs) if hasattr(base, "cost") else Cost()

    @classmethod
    def training_cost(cls, cfg: "ModelConfig", specs: "list[LayerSpec]") -> Cost:
        """What only training runs: the early-exit loss's readouts, one head matmul per exit
        (the final norm is not counted, by the accounting's convention)."""
        if cfg.layer_dropout.exit_loss <= 0:
            return Cost()
        from archlab.model.core.spec import layer_visits
        from archlab.model.variants.layer_dropout import trained_exits

        final = specs[layer_visits(cfg)[-1]].d
        return Cost(flops=len(trained_exits(cfg)) * 2 * final * cfg.vocab_size)


class ExitLoss:
    """``on_exit`` of a training run: after each visit in ``visits`` (0-based), the next-token
    loss of that exit's readout (the shared final norm and head, without the logits kept),
    scaled by ``weight``, joins the run's training-only losses."""

    def __init__(self, model: Any, targets: Any, aux: Any, visits: list[int], weight: float) -> None:
        self.model, self.targets, self.aux = model, targets, aux
        self.visits = frozenset(visits)
        self.weight = weight

    def __call__(self, visit: int, hidden: Any) -> None:
        from archlab.kernels.linear_cross_entropy import linear_cross_entropy

        loss = linear_cross_entropy(hidden.flatten(0, 1), self.model.lm_head.weight, self.targets.flatten())
        self.aux.items.append(loss * self.weight)
