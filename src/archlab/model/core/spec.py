"""Per-layer specs: the sizes every component of one layer is built from.

``layer_specs(cfg)`` asks the ``width`` slot for each layer's width and the ``heads`` slot for its
attention heads, so the modules, the accounting and the KV cache read one list instead of
recomputing a schedule each. Torch-free: ``archlab info`` and the lab's budgets use it too.

The core's kinds of the three layer-shape slots live here: ``uniform`` heads (the config's
``n_heads``/``n_kv_heads``/``head_dim``, or the per-layer ``layer_heads`` list at fixed width, the
query-per-KV group kept), ``uniform`` width and the ``sequential`` layer schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from archlab.typed import round_up

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig


@dataclass(frozen=True)
class LayerSpec:
    layer: int
    d: int  # the layer's width (its sublayers read and write d-wide vectors)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int  # the dense FFN hidden size at this width
    sinks: bool = False  # attention with a learned per-head sink logit (model.attn_sinks)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


class UniformWidth:
    """Every layer at ``d_model``.

    A width kind gives each layer's width (``widths``), the width of the token embedding
    (``base_width``), the FFN hidden size at a width (``hidden``) and may adjust a layer's heads
    to its width (``heads``). Between layers of different widths the residual stream resizes
    itself (``resize`` of the residual kinds, ``archlab.model.core.residual``).
    """

    def __init__(self, cfg: "ModelConfig") -> None:
        self.cfg = cfg

    def widths(self) -> list[int]:
        return [self.cfg.d_model] * self.cfg.n_layers

    def base_width(self) -> int:
        return self.cfg.d_model

    def heads(self, n_heads: int, n_kv_heads: int, head_dim: int, width: int) -> tuple[int, int, int]:
        return n_heads, n_kv_heads, head_dim

    def hidden(self, width: int) -> int:
        """The FFN hidden size at ``width``: ``ffn_hidden`` or 8/3 of the width (multiple of 64)."""
        if self.cfg.ffn_hidden and width == self.cfg.d_model:
            return self.cfg.ffn_hidden
        return round_up(int(8 * width / 3), 64)


class UniformHeads:
    """``n_heads`` x ``head_dim`` everywhere, or ``layer_heads[l]`` heads of width ``d / heads``."""

    def __init__(self, cfg: "ModelConfig") -> None:
        self.cfg = cfg

    def heads(self, layer: int, width: int) -> tuple[int, int, int]:
        cfg = self.cfg
        if cfg.layer_heads is None:
            return cfg.n_heads, cfg.kv_heads, cfg.dim_per_head
        h = cfg.layer_heads[layer]
        group = cfg.n_heads // cfg.kv_heads
        return h, max(1, h // group), width // h


class Sequential:
    """Every layer once, in order.

    A schedule kind's ``visits()`` lists layer indices in the order a forward pass runs them. A
    layer may appear more than once (a loop: the same weights run again on a later hidden state)
    or not at all (a skipped layer: its parameters exist but never run). The core keys the KV
    cache, the residual sites, the rows' taps and the per-run costs by *visit* (position in this
    list), so any fixed list works; it is fixed per config (a draw per step is not supported).

    Optional hooks a kind may add (the core uses each only if present):

    * ``keep(visit, rows, device)``: in training only, which rows run a visit: None (all, as
      usual) or (kept row indices [k] on ``device``, the scale of their update); the decoder
      runs the block on the kept rows alone (layer dropout; the state must be the standard
      stream's hidden tensor). ``set_training_progress(fraction)`` hears how far training is.
    * ``between()``: a module built with the model (after every other) whose ``before`` lists
      visits; the decoder calls ``module(state, visit, model)`` on the residual state before
      each of them (DiscoLoop's channel between loop iterations).
    * classmethods ``cost(cfg, specs) -> Cost`` (the kind's own components) and
      ``training_keep(cfg)`` (each visit's mean probability of running in training, which the
      accounting's training FLOPs weight it by).
    """

    def __init__(self, cfg: "ModelConfig") -> None:
        self.cfg = cfg

    def visits(self) -> list[int]:
        return list(range(self.cfg.n_layers))


def _slot(cfg: "ModelConfig", slot: str):
    return cfg.variant(slot).load()(cfg)


def layer_specs(cfg: "ModelConfig") -> list[LayerSpec]:
    width = _slot(cfg, "width")
    heads = _slot(cfg, "heads")
    specs = []
    for layer, d in enumerate(width.widths()):
        h, kvh, hd = width.heads(*heads.heads(layer, d), d)
        specs.append(LayerSpec(layer=layer, d=d, n_heads=h, n_kv_heads=kvh, head_dim=hd, hidden=width.hidden(d),
                               sinks=cfg.attn_sinks))
    return specs


def base_width(cfg: "ModelConfig") -> int:
    """The width of the token embedding (and of every follower row's embedding)."""
    return _slot(cfg, "width").base_width()


def layer_visits(cfg: "ModelConfig") -> list[int]:
    """Layer indices in the order a forward pass runs them (the ``schedule`` slot)."""
    return list(_slot(cfg, "schedule").visits())


def n_visits(cfg: "ModelConfig") -> int:
    """How many layer runs one forward pass makes (``n_layers`` for the sequential schedule)."""
    return len(layer_visits(cfg))


def visit_specs(cfg: "ModelConfig", specs: list[LayerSpec] | None = None) -> list[LayerSpec]:
    """The spec of each visit, in schedule order: what the residual stream, the KV cache and the
    per-run costs are sized by (a layer visited twice appears twice, a skipped one not at all)."""
    specs = layer_specs(cfg) if specs is None else specs
    return [specs[layer] for layer in layer_visits(cfg)]
