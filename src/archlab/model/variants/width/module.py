"""Variable width (><former): per-layer widths ``w_l``, wide early and late, narrow near 3/4 depth.

* **Schedule.** With base width ``W``, bottleneck ratio ``r`` (``bottleneck``) and bottleneck layer
  ``b = round(bottleneck_at * (L - 1))`` (kept in ``1 .. L - 2``): ``w_l = W r^(l / b)`` for
  ``l <= b`` (geometric shrink) and ``w_l = W r^((L - 1 - l) / (L - 1 - b))`` after it (geometric
  growth back to ``W`` at the last layer), each rounded to the nearest multiple of
  ``multiple_of`` (at least one multiple).
* **Base width.** ``W`` is the multiple of ``multiple_of`` whose model has the parameters of the
  uniform model of width ``d_model`` most closely (exact accounting of the whole model, whatever
  the other slots hold); the embedding and unembedding are ``W`` wide.
* **Heads.** Every layer has ``w_l / head_dim`` heads of width ``head_dim`` (16: the spec's "heads
  at w_l/16"), with the config's query-per-KV-head ratio; ``head_dim: 0`` keeps the config's head
  width and scales the head count.
* **Residual resizing** is the residual kind's (``resize``): parameter-free; shrinking truncates,
  growing refills from the most recent earlier state that was wide enough (zero if none).
* **FFN hidden** at each layer is the dense rule at that layer's width (8/3 w, multiple of 64).
"""

from __future__ import annotations

import copy
import functools
import json
from typing import TYPE_CHECKING

from archlab.model.core.spec import UniformWidth

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig


def schedule(n_layers: int, base: int, bottleneck: float, at: float, multiple: int) -> list[int]:
    b = min(max(1, round(at * (n_layers - 1))), n_layers - 2)
    widths = []
    for layer in range(n_layers):
        frac = layer / b if layer <= b else (n_layers - 1 - layer) / (n_layers - 1 - b)
        w = base * bottleneck ** frac
        widths.append(max(multiple, int(round(w / multiple)) * multiple))
    return widths


@functools.lru_cache(maxsize=64)
def _solve(tree_json: str) -> int:
    """The base width whose model's parameters are closest to the uniform model's."""
    from archlab.model.accounting import param_counts
    from archlab.model.config import ModelConfig

    cfg = ModelConfig.from_dict(json.loads(tree_json))
    uniform = copy.deepcopy(cfg)
    uniform.width = "uniform"
    target = param_counts(uniform)["params_total"]
    m = cfg.variable_width.multiple_of
    best, best_gap = cfg.d_model, None
    for base in range(m * max(1, cfg.d_model // m), 4 * cfg.d_model + m, m):
        trial = copy.deepcopy(cfg)
        trial.variable_width.base_width = base
        gap = abs(param_counts(trial)["params_total"] - target)
        if best_gap is None or gap < best_gap:
            best, best_gap = base, gap
        elif gap > best_gap:  # the count grows with the base width: past the best
            break
    return best


class VariableWidth(UniformWidth):
    def __init__(self, cfg: "ModelConfig") -> None:
        super().__init__(cfg)
        self.opts = cfg.variable_width

    def base_width(self) -> int:
        if self.opts.base_width:
            return self.opts.base_width
        return _solve(json.dumps(self.cfg.to_dict(full=True), sort_keys=True))

    def widths(self) -> list[int]:
        o = self.opts
        return schedule(self.cfg.n_layers, self.base_width(), o.bottleneck, o.bottleneck_at, o.multiple_of)

    def hidden(self, width: int) -> int:
        return super().hidden(width) if width != self.cfg.d_model or not self.cfg.ffn_hidden else self.cfg.ffn_hidden

    def heads(self, n_heads: int, n_kv_heads: int, head_dim: int, width: int) -> tuple[int, int, int]:
        hd = self.opts.head_dim or self.cfg.dim_per_head
        group = self.cfg.n_heads // self.cfg.kv_heads
        n = max(group, width // hd // group * group)
        return n, n // group, hd
