"""``ModelConfig``: the core's sizes, the kind chosen for each slot, and the variants' own sections.

The core fields are the baseline's (spec section 0). A slot is chosen by a plain string
(``ffn: moe``); no list of kinds lives here, the registry knows them (``archlab.model.registry``).
A variant's options are its own dataclass under ``model.<section>`` (``model.moe.top_k``); the
config holds one instance of every registered section, so ``cfg.moe.top_k`` always reads, and
checks only the sections of the variants it uses (their ``validate(model_cfg)``).

Importing this module imports no torch: the command line checks a config before loading it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from archlab.model import registry
from archlab.model.core.spec import base_width, layer_specs, layer_visits
from archlab.typed import CONFIG, build, check, round_up


@dataclass(init=False, eq=False)
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 = n_heads (no grouping)
    head_dim: int = 0  # 0 = d_model // n_heads
    ffn_hidden: int = 0  # 0 = 8/3 * d_model rounded up to a multiple of 64
    layer_heads: list[int] | None = None  # per-layer query-head schedule (head_dim = d/heads)
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    #: a learned per-head "sink" logit in every attention softmax: one more key whose value is 0
    #: (gpt-oss style); gamma-init's companion setting. Off: SDPA's flash kernels stay usable.
    attn_sinks: bool = False
    # ---- the kind of each slot (see archlab.model.registry; `archlab config --list` lists them)
    heads: str = "uniform"
    width: str = "uniform"
    position: str = "rope"
    norm: str = "rmsnorm"
    init: str = "normal"
    ffn: str = "swiglu"
    schedule: str = "sequential"
    #: what the model is trained to do: ``autoregressive`` (next-token prediction) or a rows kind
    #: that is an objective of its own (its options' ``OBJECTIVE``: ``uniform-diffusion``)
    objective: str = "autoregressive"

    #: core fields added after runs were recorded, left out at their defaults (``_without_later``)
    LATER_FIELDS = ("objective",)

    def __init__(self, **values: Any) -> None:
        """Core fields by name; variant sections by their section name (``moe=MoEConfig(...)``)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, copy.deepcopy(values.pop(f.name)) if f.name in values else copy.deepcopy(f.default))
        owners = registry.sections()
        for name in values:
            if name not in owners:
                CONFIG.unknown(f"model.{name}", self.allowed_keys())
        self._sections = {name: values[name] if name in values else v.options() for name, v in owners.items()}

    # ---- sections -------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not attributes: the variant sections.
        sections = self.__dict__.get("_sections")
        if sections is not None and name in sections:
            return sections[name]
        raise AttributeError(f"ModelConfig has no field or section {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        sections = self.__dict__.get("_sections")
        if sections is not None and name in sections:
            sections[name] = value
        else:
            object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelConfig) and self.to_dict(full=True) == other.to_dict(full=True)

    @classmethod
    def slot_fields(cls) -> list[str]:
        """The fields that name a slot's kind (``objective`` too: another objective is a rows kind)."""
        return [s.key for s in registry.SLOTS.values() if s.key is not None and "." not in s.key] + ["objective"]

    @classmethod
    def allowed_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)] + sorted(registry.sections())

    @classmethod
    def from_dict(cls, tree: dict[str, Any], prefix: str = "model") -> "ModelConfig":
        owners = registry.sections()

        def section(name: str, value: Any, key: str) -> Any:
            if name not in owners:
                CONFIG.unknown(key, cls.allowed_keys())
            check(isinstance(value, dict), key, f"expected a mapping, got {value!r}")
            return build(owners[name].options, value, key)

        return build(cls, tree, prefix, extra=section)

    def to_dict(self, full: bool = False) -> dict[str, Any]:
        """Core fields plus the sections this model uses, or that differ from their defaults
        (``full``: every section). A run's config hash is taken over this, so registering a new
        variant does not change the hash of runs that do not use it."""
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        used = {v.section_name for v in registry.chosen(self).values()} if not full else set()
        for name, value in self._sections.items():
            d = dataclasses.asdict(value)
            default = dataclasses.asdict(type(value)())
            if full or name in used or d != default:
                out[name] = d if full else _without_later(d, default, type(value))
        core_defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return out if full else _without_later(out, core_defaults, ModelConfig)

    # ---- derived sizes (the baseline's; per-layer sizes come from model.core.spec) -----------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def hidden(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return round_up(int(8 * self.d_model / 3), 64)

    def variant(self, slot: str) -> registry.Variant:
        return registry.lookup(self, slot)

    def uses(self, slot: str, kind: str) -> bool:
        return registry.kind_of(self, slot) == kind

    def validate(self) -> "ModelConfig":
        check(self.d_model > 0 and self.n_layers > 0 and self.vocab_size > 1, "model",
              "d_model, n_layers and vocab_size must be positive")
        check(self.n_heads > 0, "model.n_heads", "must be positive")
        check(self.n_kv_heads >= 0 and self.n_heads % self.kv_heads == 0, "model.n_kv_heads",
              f"must divide n_heads={self.n_heads}, got {self.n_kv_heads}")
        check(self.dim_per_head % 2 == 0, "model.head_dim", "must be even for RoPE")
        if not self.head_dim:
            check(self.d_model % self.n_heads == 0, "model.n_heads",
                  f"must divide d_model={self.d_model} (or set model.head_dim)")
        if self.layer_heads is not None:
            check(len(self.layer_heads) == self.n_layers, "model.layer_heads",
                  f"needs one entry per layer ({self.n_layers}), got {len(self.layer_heads)}")
            group = self.n_heads // self.kv_heads
            for h in self.layer_heads:
                check(h > 0 and self.d_model % h == 0 and (self.d_model // h) % 2 == 0,
                      "model.layer_heads", f"{h} heads must split d_model={self.d_model} into even head dims")
                check(h % group == 0, "model.layer_heads",
                      f"{h} heads is not a multiple of the q-per-kv group {group}")
        check(self.init_std > 0 and math.isfinite(self.init_std), "model.init_std",
              f"must be a positive finite number, got {self.init_std}")
        check(self.rope_theta > 0 and math.isfinite(self.rope_theta), "model.rope_theta",
              f"must be a positive finite number, got {self.rope_theta}")
        check(self.max_seq_len > 0, "model.max_seq_len", "must be positive")
        check(self.norm_eps > 0 and math.isfinite(self.norm_eps), "model.norm_eps", "must be positive")
        # An objective other than next-token prediction is a rows kind that says so (its options'
        # OBJECTIVE) and switches itself on when this key names it.
        rows_kinds = registry.variants("rows").values()
        objectives = ["autoregressive"] + sorted(v.options.OBJECTIVE for v in rows_kinds if hasattr(v.options, "OBJECTIVE"))
        check(self.objective in objectives, "model.objective",
              f"must be one of {', '.join(objectives)}, got {self.objective!r}")
        chosen = registry.chosen(self)  # every kind registered, no excluded pair
        # The core keys the KV cache, the residual sites, the rows' taps and the per-run costs by
        # visit, so a schedule may reorder, repeat (loop) or skip layers; it must name real layers.
        visits = layer_visits(self)
        check(len(visits) > 0 and all(isinstance(v, int) and 0 <= v < self.n_layers for v in visits),
              "model.schedule", f"{self.schedule!r} visits layers {visits}; a schedule needs at least one "
              f"visit, each a layer index in 0..{self.n_layers - 1}")
        seen = set()
        for v in chosen.values():
            name = v.section_name
            if name is not None and name not in seen and hasattr(self._sections[name], "validate"):
                seen.add(name)
                self._sections[name].validate(self)
        if len(set(visits)) < len(visits):
            # The width kinds' resize (truncate; refill grown coordinates from the last wider
            # state) is written for one pass over the layers; what a loop's second shrink-and-grow
            # should refill from is a modelling choice not made here, so the pair is refused.
            widths = {s.d for s in layer_specs(self)} | {base_width(self)}
            check(len(widths) == 1, "model.schedule",
                  f"{self.schedule!r} runs a layer more than once, which cannot be combined with model.width "
                  f"{self.width!r} (its widths {sorted(widths)} vary across the layers a loop would repeat)")
        return self


def _without_later(tree: dict[str, Any], default: dict[str, Any], cls: type) -> dict[str, Any]:
    """``tree`` without the fields of ``cls.LATER_FIELDS`` that hold their defaults: fields added
    after runs were recorded, whose defaults compute what those runs computed. A run's id is a hash
    of its config, so without this every new option would give every finished run a new id, and
    a suite resumed after an upgrade would train all its runs again."""
    return {k: v for k, v in tree.items() if k not in getattr(cls, "LATER_FIELDS", ()) or v != default[k]}
