"""Exact cost accounting from a config: parameters, FLOPs per phase, KV and decode bytes.

Conventions (stated once, used everywhere, including MFU and iso-FLOP budgets):

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

The decode branch adds rows, not weights: prefill is the baseline's, decode and training run
``1 + n_branches`` rows, the branch rows compute no keys/values and read no extra weights but
their embedding row and the coupling vectors.
"""

from __future__ import annotations

from typing import Any

from archlab.config import ModelConfig
from archlab.model.ffn import ffn_param_counts
from archlab.model.residual import residual_type


def _layer_attn(cfg: ModelConfig, layer: int) -> tuple[int, int, int]:
    """(attention projection params, q_dim, kv_dim) of one layer."""
    h, kvh, hd = cfg.heads_at(layer)
    q_dim, kv_dim = h * hd, kvh * hd
    return cfg.d_model * (2 * q_dim + 2 * kv_dim), q_dim, kv_dim


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    d, V = cfg.d_model, cfg.vocab_size
    R = cfg.branch.n_branches if cfg.branch.enabled else 0
    ffn = ffn_param_counts(cfg)
    coupling_hidden = ffn.get("coupling_hidden", cfg.hidden if cfg.ffn == "swiglu" else 0)
    attn = sum(_layer_attn(cfg, l)[0] for l in range(cfg.n_layers))
    q_dims = sum(_layer_attn(cfg, l)[1] for l in range(cfg.n_layers))
    norms = cfg.n_layers * 2 * d + d
    coupling = R * (q_dims + cfg.n_layers * (coupling_hidden + d)) if cfg.branch.coupling else 0
    residual = residual_type(cfg).param_count(cfg)
    embed = V * d
    branch_embed = R * V * d
    head = 0 if cfg.tie_embeddings else V * d
    total = embed + branch_embed + head + attn + cfg.n_layers * ffn["total"] + norms + coupling + residual
    inactive_experts = cfg.n_layers * (ffn["total"] - ffn["active"])
    return {
        "params_total": total,
        "params_embedding": embed + branch_embed,
        # What the primary row touches: every weight but unused experts and branch-only tensors.
        "params_active": total - inactive_experts - branch_embed - coupling,
        "params_branch_extra": branch_embed + coupling,
    }


def _row_forward_flops(cfg: ModelConfig, keys: float, branch_row: bool) -> float:
    """Forward FLOPs of one row (one token) attending to ``keys`` keys in every layer."""
    ffn = ffn_param_counts(cfg)
    flops = 0.0
    for l in range(cfg.n_layers):
        proj, q_dim, kv_dim = _layer_attn(cfg, l)
        if branch_row:  # the branch projects its query and output only; K/V are the primary's
            proj -= 2 * cfg.d_model * kv_dim
        flops += 2 * proj + 4 * q_dim * keys
        flops += 2 * (ffn["active_branch"] if branch_row else ffn["active"])
    flops += 2 * cfg.d_model * cfg.vocab_size  # unembedding
    flops += residual_type(cfg).flops_per_token(cfg)
    return flops


def _rows(cfg: ModelConfig) -> int:
    return cfg.branch.n_branches if cfg.branch.enabled else 0


def prefill_flops_per_token(cfg: ModelConfig, prompt_len: int) -> float:
    """Mean forward FLOPs per prompt token (primary path only: the branch is not run in prefill)."""
    return _row_forward_flops(cfg, (prompt_len + 1) / 2, branch_row=False)


def decode_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """FLOPs to produce one new token at ``context`` keys: primary row plus branch rows."""
    return (_row_forward_flops(cfg, context, False)
            + _rows(cfg) * _row_forward_flops(cfg, context, True))


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    keys = (seq_len + 1) / 2
    fwd = _row_forward_flops(cfg, keys, False) + _rows(cfg) * _row_forward_flops(cfg, keys, True)
    return 3 * fwd


def mfu_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """PaLM convention: 6 N (non-embedding matmul params per row) + 12 L q_dim T, over all rows."""
    full_keys = seq_len  # non-causal attention, as the convention counts it
    fwd = _row_forward_flops(cfg, full_keys, False) + _rows(cfg) * _row_forward_flops(cfg, full_keys, True)
    return 3 * fwd


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    return sum(2 * _layer_attn(cfg, l)[2] * dtype_bytes for l in range(cfg.n_layers))


def decode_bytes_per_step(cfg: ModelConfig, context: int, batch: int = 1, dtype_bytes: int = 2) -> float:
    """Bytes read (and KV written) by one decode step of ``batch`` sequences at ``context``.

    MoE: at batch 1 the step reads the primary's ``top_k`` experts (router replay adds none;
    independent routing may add up to ``branch_top_k`` more, counted as the upper bound); at larger
    batches the union of experts is bounded by ``n_experts``.
    """
    counts = param_counts(cfg)
    ffn = ffn_param_counts(cfg)
    weights = counts["params_total"] - counts["params_embedding"]
    if cfg.tie_embeddings:
        weights += cfg.vocab_size * cfg.d_model  # the tied table is read whole as the unembedding
    if cfg.ffn == "moe":
        per_expert = ffn["per_expert"]  # bytes of one routed expert's three matrices, in params
        used = min(cfg.moe.n_experts, batch * cfg.moe.top_k)
        if cfg.branch.enabled and cfg.moe.branch_routing == "independent":
            used = min(cfg.moe.n_experts, used + batch * _rows(cfg) * (cfg.moe.branch_top_k or cfg.moe.top_k))
        weights -= cfg.n_layers * (cfg.moe.n_experts - used) * per_expert
    rows = batch * (1 + _rows(cfg))
    embed_rows = rows * cfg.d_model
    kv = kv_bytes_per_token(cfg, dtype_bytes)
    return (weights + embed_rows) * dtype_bytes + batch * context * kv + batch * kv


def costs(cfg: ModelConfig, context: int, batch: int = 1, dtype_bytes: int = 2) -> dict[str, Any]:
    """Every cost column of the methodology, for one config at one context length."""
    out: dict[str, Any] = dict(param_counts(cfg))
    out.update(
        train_flops_per_token=train_flops_per_token(cfg, context),
        prefill_flops_per_token=prefill_flops_per_token(cfg, context),
        decode_flops_per_token=decode_flops_per_token(cfg, context),
        kv_bytes_per_token=kv_bytes_per_token(cfg, dtype_bytes),
        decode_bytes_per_step=decode_bytes_per_step(cfg, context, batch, dtype_bytes),
        context=context,
        batch=batch,
        dtype_bytes=dtype_bytes,
    )
    return out
