"""Export through transformers' remote code: what the shipped modeling file supports, and its layout.

``modeling_archlab.py`` and ``configuration_archlab.py`` (beside this file) are copied verbatim
into an export folder; ``config.json`` names them in ``auto_map``, so
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` builds the model without
archlab. They read the model from ``layout``, which ``layout_of`` resolves here from a built archlab
model: per-layer shapes, the visit order, the norm, the FFN, the loop channel. Resolving the rules
here (Prism's head schedule, variable width's widths, TriPLU's hidden size, a loop's visits) keeps
the modeling file free of archlab's option names and of every rule a later archlab may change.

``unsupported(model)`` names the first option the modeling file does not implement (one line for
the user), or returns None.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from archlab.model import registry

HERE = Path(__file__).parent
#: the files copied into the export folder, each loaded by transformers from there
FILES = ("configuration_archlab.py", "modeling_archlab.py")
MODEL_TYPE = "archlab"
ARCHITECTURE = "ArchlabForCausalLM"
AUTO_MAP = {"AutoConfig": "configuration_archlab.ArchlabConfig",
            "AutoModelForCausalLM": "modeling_archlab.ArchlabForCausalLM"}

#: per slot, the kinds the modeling file implements; a slot not named here is supported at its
#: default kind only, so a slot or kind added to archlab later is refused until this file learns it
SUPPORTED = {"rows": {"primary", "branch"}, "residual": {"standard", "attnres", "delta"},
             "ffn": {"swiglu", "triplu", "moe"}, "norm": {"rmsnorm", "layerrope"}, "position": {"rope"}}
#: slots whose every kind is resolved into plain numbers by ``layout_of`` (the layer shapes, the
#: visit order and the loop channel), or that decide no function (the init)
RESOLVED = {"heads", "width", "schedule", "init"}


def unsupported(model) -> str | None:
    """The first option of ``model`` that ``modeling_archlab.py`` cannot compute, or None."""
    cfg = model.cfg
    for slot in registry.SLOTS:
        if slot in RESOLVED:
            continue
        kind = registry.kind_of(cfg, slot)
        if kind not in SUPPORTED.get(slot, {registry.SLOTS[slot].default}):
            key = registry.SLOTS[slot].key
            if key is None:  # a rows kind is switched on by its own section
                return f"the {kind!r} rows kind (model.{registry.lookup(cfg, slot).section or slot})"
            return f"model.{key} {kind!r}"
    if registry.kind_of(cfg, "rows") == "branch" and registry.kind_of(cfg, "ffn") == "moe":
        return "the decode branch with mixture-of-experts layers (router replay, model.branch with model.ffn 'moe')"
    if model.between is not None:
        from archlab.model.variants.looped.module import DiscreteChannel

        if not isinstance(model.between, DiscreteChannel):
            return f"the schedule's between-visit module {type(model.between).__name__}"
        if registry.kind_of(cfg, "residual") != "standard":
            return "a loop's channel over an attention-residual stream"
    return None


def layout_of(model) -> dict[str, Any]:
    """The plain-number description ``modeling_archlab.py`` builds ``model`` from."""
    cfg = model.cfg
    layers = [{"d": s.d, "n_heads": s.n_heads, "n_kv_heads": s.n_kv_heads, "head_dim": s.head_dim,
               # the FFN module's own hidden size: TriPLU solves its own, an expert has its own
               "hidden": int(getattr(block.mlp, "hidden", 0) or getattr(block.mlp, "expert_hidden", 0)),
               "coupling_width": int(type(block.mlp).coupling_width(cfg, s)), "sinks": bool(s.sinks)}
              for s, block in zip(model.specs, model.layers)]
    norm_kind = registry.kind_of(cfg, "norm")
    norm: dict[str, Any] = {"kind": norm_kind}
    if norm_kind == "layerrope":
        o = cfg.layerrope
        norm.update(a=o.a, b=o.b, a_rot=o.a_rot, b_rot=o.b_rot, base=o.base, learnable=o.learnable,
                    per_site=o.per_site, out_sites=o.out_sites, final=o.final)
    ffn_kind = registry.kind_of(cfg, "ffn")
    ffn: dict[str, Any] = {"kind": ffn_kind}
    if ffn_kind == "triplu":
        ffn.update(degree=cfg.triplu.degree, norm=cfg.triplu.norm)
    if ffn_kind == "moe":
        ffn.update(n_experts=cfg.moe.n_experts, top_k=cfg.moe.top_k, shared_expert=cfg.moe.shared_expert)
    residual: dict[str, Any] = {"kind": registry.kind_of(cfg, "residual")}
    if residual["kind"] != "standard":
        # the resolved block (or delta group) count and the width the sources are stored at
        residual.update(heads=model.residual.heads, blocks=model.residual.n_blocks, width=model.residual.d)
    branch = None
    if registry.kind_of(cfg, "rows") == "branch":
        b = cfg.branch
        branch = {"n_branches": b.n_branches, "coupling": b.coupling, "readout": b.readout,
                  "alpha_min": b.alpha_min, "alpha_max": b.alpha_max}
    channel = None
    if model.between is not None:
        b = model.between
        # realignment skips the channel in training only: inference, and so the export, runs it
        channel = {"before": sorted(b.before), "tau": b.tau, "alpha": b.alpha,
                   "learned": b.gate_weight is not None}
    return {"layers": layers, "visits": list(model.visits), "base_width": model.base_width,
            "norm": norm, "ffn": ffn, "residual": residual, "branch": branch, "channel": channel,
            "norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "max_seq_len": cfg.max_seq_len,
            "tie_embeddings": cfg.tie_embeddings}


def hf_config(model, archlab_model: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of the remote-code export of ``model`` (the special tokens are added by
    the caller, as for a Llama export)."""
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "auto_map": dict(AUTO_MAP),
            "vocab_size": model.cfg.vocab_size, "hidden_size": model.base_width,
            "num_hidden_layers": len(model.layers), "max_position_embeddings": model.cfg.max_seq_len,
            "tie_word_embeddings": False, "torch_dtype": "float32", "layout": layout_of(model),
            "archlab_model": archlab_model}


def write_files(folder: Path) -> None:
    """Copy the modeling and configuration files, unchanged, into ``folder``."""
    for name in FILES:
        shutil.copyfile(HERE / name, folder / name)
