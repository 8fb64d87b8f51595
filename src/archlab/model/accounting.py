"""Exact cost accounting from a config: parameters, FLOPs per phase, KV and decode bytes.

Every component states its own cost (``cost`` classmethods returning ``core.cost.Cost``); this
module only lists a config's components and sums. Conventions (stated once, used everywhere,
including MFU and iso-FLOP budgets):

* A matrix multiply of a row by a ``m x n`` weight costs ``2 m n`` FLOPs. Norms, activations,
  softmaxes and RoPE are not counted (they are a few percent at these sizes and bandwidth-bound).
* Attention costs ``4 * q_dim * c`` FLOPs per query row and layer (``QK^T`` and ``AV``) where ``c``
  is the number of keys it attends to. Prefill and training count the causal triangle exactly:
  position ``t`` (0-based) attends to ``t + 1`` keys, so the mean over a sequence of length ``S``
  is ``(S + 1) / 2``. Decode at context ``C`` attends to ``C`` keys (the new token included).
* Training FLOPs are 3x the forward (backward = 2x forward).
* ``mfu_flops_per_token`` is the PaLM/nanoGPT convention ``6 N + 12 L q_dim T`` (non-causal
  attention), so MFU figures are comparable with the literature and with the anchor script.
* Decode bytes per step: every weight the step uses is read once (embedding tables only one row
  per token), plus the whole KV cache at that context, plus the new keys/values written.

Follower rows (the decode branch's) add rows, not weights: prefill is the primary's alone,
decode and training run ``1 + followers`` rows; followers compute no keys/values and read no
extra weights but their embedding row and the coupling vectors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from archlab.model import registry
from archlab.model.config import ModelConfig
from archlab.model.core.cost import Cost
from archlab.model.core.layers import Attention
from archlab.model.core.spec import base_width, layer_specs, layer_visits


@dataclass
class Part:
    name: str  # "embedding", "rows", "residual", "L3.attn", "L3.ffn", "L3.norms", "final_norm", "head"
    layer: int | None
    cost: Cost


def parts(cfg: ModelConfig) -> list[Part]:
    """Every component of ``cfg``'s model with its cost."""
    V = cfg.vocab_size
    specs = layer_specs(cfg)
    d = base_width(cfg)  # the embedding's width
    final = specs[layer_visits(cfg)[-1]].d  # the unembedding's
    norm = cfg.variant("norm").load()
    ffn = cfg.variant("ffn").load()
    out = [Part("embedding", None, Cost(params=V * d, embedding=V * d))]
    out.append(Part("rows", None, cfg.variant("rows").load().cost(cfg, specs)))
    out.append(Part("residual", None, cfg.variant("residual").load().cost(cfg, specs)))
    for s in specs:
        norms = Cost(params=sum(norm.cost(cfg, site, s.d).params for site in ("attn_in", "attn_out", "mlp_in", "mlp_out")))
        out += [Part(f"L{s.layer}.attn", s.layer, Attention.cost(cfg, s)),
                Part(f"L{s.layer}.ffn", s.layer, ffn.cost(cfg, s)),
                Part(f"L{s.layer}.norms", s.layer, norms)]
    out.append(Part("final_norm", None, norm.cost(cfg, "final", final)))
    head = Cost(params=0 if cfg.tie_embeddings else V * final, flops=2 * final * V,
                # a tied table is read whole as the unembedding
                decode_params=(lambda batch: V * final) if cfg.tie_embeddings else None)
    out.append(Part("head", None, head))
    return out


def followers(cfg: ModelConfig) -> int:
    """Follower rows per token (they run in training and decode, not in prefill)."""
    return registry.followers(cfg)


def param_counts(cfg: ModelConfig, ps: list[Part] | None = None) -> dict[str, int]:
    cs = [p.cost for p in (ps or parts(cfg))]
    return {
        "params_total": sum(c.params for c in cs),
        "params_embedding": sum(c.embedding for c in cs),
        # What a primary row touches: every weight but unused experts and follower-only tensors.
        "params_active": sum(c.active_params - c.follower_only for c in cs),
        "params_branch_extra": sum(c.follower_only for c in cs),
    }


# ``ps``: the config's parts when the caller has them already (``costs`` lists them once).
def _row_flops(ps: list[Part], keys: float, follower: bool) -> float:
    return sum(p.cost.row_flops(keys, follower) for p in ps)


def _all_rows_flops(cfg: ModelConfig, keys: float, ps: list[Part] | None = None) -> float:
    ps = ps or parts(cfg)
    return _row_flops(ps, keys, False) + followers(cfg) * _row_flops(ps, keys, True)


def prefill_flops_per_token(cfg: ModelConfig, prompt_len: int, ps: list[Part] | None = None) -> float:
    """Mean forward FLOPs per prompt token (primary rows only: followers do not run in prefill)."""
    return _row_flops(ps or parts(cfg), (prompt_len + 1) / 2, False)


def decode_flops_per_token(cfg: ModelConfig, context: int, ps: list[Part] | None = None) -> float:
    """FLOPs to produce one new token at ``context`` keys: the primary row plus follower rows."""
    return _all_rows_flops(cfg, context, ps)


def train_flops_per_token(cfg: ModelConfig, seq_len: int, ps: list[Part] | None = None) -> float:
    return 3 * _all_rows_flops(cfg, (seq_len + 1) / 2, ps)


def mfu_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """PaLM convention: 6 N (non-embedding matmul params per row) + 12 L q_dim T, over all rows."""
    return 3 * _all_rows_flops(cfg, seq_len)  # non-causal attention, as the convention counts it


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2, ps: list[Part] | None = None) -> int:
    return sum(p.cost.kv_elems for p in (ps or parts(cfg))) * dtype_bytes


def decode_bytes_per_step(cfg: ModelConfig, context: int, batch: int = 1, dtype_bytes: int = 2,
                          ps: list[Part] | None = None) -> float:
    """Bytes read (and KV written) by one decode step of ``batch`` sequences at ``context``."""
    ps = ps or parts(cfg)
    weights = sum(p.cost.params_read_by_decode(batch) for p in ps)
    embed_rows = batch * (1 + followers(cfg)) * base_width(cfg)
    kv = kv_bytes_per_token(cfg, dtype_bytes, ps)
    return (weights + embed_rows) * dtype_bytes + batch * context * kv + batch * kv


def per_layer(cfg: ModelConfig, context: int, dtype_bytes: int = 2) -> list[dict[str, Any]]:
    """Per layer: width, heads, parameters, prefill/decode FLOPs per token and KV bytes per token."""
    ps = parts(cfg)
    rows = []
    nf = followers(cfg)
    for s in layer_specs(cfg):
        layer = [p.cost for p in ps if p.layer == s.layer]
        prefill = sum(c.row_flops((context + 1) / 2) for c in layer)
        decode = sum(c.row_flops(context) + nf * c.row_flops(context, True) for c in layer)
        rows.append({"layer": s.layer, "width": s.d, "heads": s.n_heads, "kv_heads": s.n_kv_heads,
                     "head_dim": s.head_dim, "params": sum(c.params for c in layer),
                     "prefill_flops_per_token": prefill, "decode_flops_per_token": decode,
                     "kv_bytes_per_token": sum(c.kv_elems for c in layer) * dtype_bytes})
    return rows


def costs(cfg: ModelConfig, context: int, batch: int = 1, dtype_bytes: int = 2) -> dict[str, Any]:
    """Every cost column of the methodology, for one config at one context length."""
    ps = parts(cfg)
    out: dict[str, Any] = dict(param_counts(cfg, ps))
    out.update(
        train_flops_per_token=train_flops_per_token(cfg, context, ps),
        prefill_flops_per_token=prefill_flops_per_token(cfg, context, ps),
        decode_flops_per_token=decode_flops_per_token(cfg, context, ps),
        kv_bytes_per_token=kv_bytes_per_token(cfg, dtype_bytes, ps),
        decode_bytes_per_step=decode_bytes_per_step(cfg, context, batch, dtype_bytes, ps),
        context=context,
        batch=batch,
        dtype_bytes=dtype_bytes,
    )
    return out
