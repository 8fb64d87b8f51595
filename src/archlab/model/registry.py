"""The plug-in contract: the model core's slots and the variants registered into them.

The core (``archlab.model.core``) is one pre-norm decoder written against a few interfaces. Each
interface is a *slot*; what fills it is a *variant* of that slot, named by a *kind*:

==========  ====================  ===============  ==========================================
slot        chosen by             core default     what a variant provides
==========  ====================  ===============  ==========================================
heads       ``model.heads``       uniform          per-layer (q heads, kv heads, head dim)
width       ``model.width``       uniform          per-layer widths
position    ``model.position``    rope             position tables and the q/k rotation
norm        ``model.norm``        rmsnorm          the norm (gain) module at each site
init        ``model.init``        normal           how each weight is drawn
ffn         ``model.ffn``         swiglu           the feed-forward sublayer
residual    ``model.residual.kind``  standard      how sublayer inputs are formed from outputs
schedule    ``model.schedule``    sequential       which layers run, in which order (loops, skips)
rows        (the variant)         primary          extra rows per token and the readout
==========  ====================  ===============  ==========================================

A variant registers itself with ``register(Variant(...))`` naming its slot, its kind, the class
that builds it (a ``"module:attr"`` string, so that registering imports no torch) and, when it
has options, their dataclass and the config key they live under (``model.<section>``). It
validates its own options (the dataclass's ``validate(model_cfg)``), initialises its own
parameters, states its own costs and runs under cached decoding; ``archlab.model.core`` says how.

Built-in variants live in ``archlab.model.variants``, one package each, whose ``__init__`` holds
the options and the registration and imports no torch; ``discover()`` imports them all. A variant
defined anywhere else (a test, a user's script) calls ``register`` itself before building a model.

The ``rows`` slot has no selecting key: a rows variant says itself whether a config switches it on
(``Variant.active``), since its switch is part of its own options (``model.branch.enabled``).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

from archlab.typed import check


@dataclass(frozen=True)
class Slot:
    name: str
    key: str | None  # dotted config key (under ``model``) that names the kind; None: see ``rows``
    default: str  # the core's own kind
    doc: str


@dataclass(frozen=True)
class Variant:
    slot: str
    kind: str
    #: the class (or factory) that builds the component: ``"package.module:Name"`` or the object
    factory: str | Callable[..., Any]
    #: the variant's options dataclass (``validate(model_cfg)`` optional), or None
    options: type | None = None
    #: config key of the options (``model.<section>``); default: the kind
    section: str | None = None
    #: rows slot only: whether a config switches this variant on
    active: Callable[[Any], bool] | None = None
    doc: str = ""
    #: kinds of other slots this variant cannot be combined with, as ``"slot:kind"``
    excludes: tuple[str, ...] = ()

    @property
    def section_name(self) -> str | None:
        if self.options is None:
            return None
        return self.section or self.kind

    def load(self) -> Callable[..., Any]:
        """The factory object (imports its module the first time)."""
        if not isinstance(self.factory, str):
            return self.factory
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)


SLOTS: dict[str, Slot] = {s.name: s for s in (
    Slot("heads", "heads", "uniform", "per-layer attention heads (count, kv heads, head dim)"),
    Slot("width", "width", "uniform", "per-layer model width"),
    Slot("position", "position", "rope", "position encoding of queries and keys"),
    Slot("norm", "norm", "rmsnorm", "normalisation and gains at the sublayer inputs and final"),
    Slot("init", "init", "normal", "initial distribution of every weight"),
    Slot("ffn", "ffn", "swiglu", "the feed-forward sublayer"),
    Slot("residual", "residual.kind", "standard", "how a sublayer's input is formed from earlier outputs"),
    Slot("schedule", "schedule", "sequential", "which layers run, in which order"),
    Slot("rows", None, "primary", "extra rows per token (decode branch) and the readout"),
)}

_VARIANTS: dict[str, dict[str, Variant]] = {name: {} for name in SLOTS}
_SECTIONS: dict[str, Variant] = {}  # section name -> the variant that owns it (first registered)
_discovered = False


def register(v: Variant) -> Variant:
    """Add ``v`` to its slot (replacing a variant of the same slot and kind)."""
    if v.slot not in SLOTS:
        raise ValueError(f"unknown slot {v.slot!r}; slots: {', '.join(SLOTS)}")
    if v.slot == "rows" and v.kind != SLOTS["rows"].default and v.active is None:
        raise ValueError(f"rows variant {v.kind!r} needs active(cfg)")
    name = v.section_name
    if name is not None:
        owner = _SECTIONS.get(name)
        if owner is not None and owner.options is not v.options:
            raise ValueError(f"config section model.{name} already holds the options of {owner.slot}:{owner.kind}")
        _SECTIONS[name] = v
    _VARIANTS[v.slot][v.kind] = v
    return v


def unregister(slot: str, kind: str) -> None:
    """Remove a variant (tests that register a toy variant clean up with this)."""
    v = _VARIANTS[slot].pop(kind, None)
    name = v.section_name if v is not None else None
    if name is not None and not any(o.section_name == name for kinds in _VARIANTS.values() for o in kinds.values()):
        del _SECTIONS[name]


def discover() -> None:
    """Import every built-in variant package once (their ``__init__`` registers them)."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    import archlab.model.variants as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{info.name}")


def variants(slot: str) -> dict[str, Variant]:
    discover()
    return dict(_VARIANTS[slot])


def sections() -> dict[str, Variant]:
    """Config sections (``model.<name>``) and the variant owning each."""
    discover()
    return dict(_SECTIONS)


def section_owners(name: str) -> list[Variant]:
    """Every variant whose options live in section ``name`` (a family may share one)."""
    discover()
    return [v for kinds in _VARIANTS.values() for v in kinds.values() if v.section_name == name]


def kind_of(cfg: Any, slot: str) -> str:
    """The kind ``cfg`` (a ModelConfig) chooses for ``slot``."""
    s = SLOTS[slot]
    if s.key is None:
        on = [v.kind for v in variants(slot).values() if v.active is not None and v.active(cfg)]
        return on[0] if on else s.default
    value: Any = cfg
    for part in s.key.split("."):
        value = getattr(value, part, None)
        if value is None:
            return s.default
    return value


def lookup(cfg: Any, slot: str) -> Variant:
    """The variant ``cfg`` chooses for ``slot`` (a config error listing the registered kinds)."""
    kind = kind_of(cfg, slot)
    registered = variants(slot)
    key = f"model.{SLOTS[slot].key or slot}"
    check(kind in registered, key, f"unknown {slot} kind {kind!r}; registered: {', '.join(sorted(registered))}")
    return registered[kind]


def followers(cfg: Any) -> int:
    """Follower rows per token of ``cfg``'s rows kind (its options' ``followers()``; 0 for none)."""
    v = lookup(cfg, "rows")
    if v.section_name is None:
        return 0
    return int(getattr(cfg, v.section_name).followers())


def chosen(cfg: Any) -> dict[str, Variant]:
    """The variant of every slot for ``cfg``, after checking kinds and exclusions."""
    out = {slot: lookup(cfg, slot) for slot in SLOTS}
    if SLOTS["rows"].key is None:  # at most one rows variant may be on
        on = [v.kind for v in variants("rows").values() if v.active is not None and v.active(cfg)]
        check(len(on) <= 1, "model", f"rows variants {' and '.join(on)} cannot be combined")
    for v in out.values():
        for ex in v.excludes:
            slot, _, kind = ex.partition(":")
            if out[slot].kind == kind:
                check(False, f"model.{SLOTS[slot].key or slot}",
                      f"{v.slot} {v.kind!r} cannot be combined with {slot} {kind!r}")
    return out


# The core's own kinds: the baseline model, one per slot.
for _slot, _factory in (
    ("heads", "archlab.model.core.spec:UniformHeads"),
    ("width", "archlab.model.core.spec:UniformWidth"),
    ("position", "archlab.model.core.layers:RoPE"),
    ("norm", "archlab.model.core.layers:RMSNormSites"),
    ("init", "archlab.model.core.init:NormalInit"),
    ("ffn", "archlab.model.core.ffn:SwiGLU"),
    ("residual", "archlab.model.core.residual:StandardResidual"),
    ("schedule", "archlab.model.core.spec:Sequential"),
    ("rows", "archlab.model.core.rows:PrimaryRows"),
):
    register(Variant(_slot, SLOTS[_slot].default, _factory, doc="baseline"))
