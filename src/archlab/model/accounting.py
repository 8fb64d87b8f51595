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
* Training FLOPs are 3x the forward (backward = 2x forward). A model trained with bidirectional
  attention (``model.objective: uniform-diffusion``) attends to all ``S`` keys at every position.
* ``mfu_flops_per_token`` is the PaLM/nanoGPT convention ``6 N + 12 L q_dim T`` (non-causal
  attention), so MFU figures are comparable with the literature and with the anchor script.
* Decode bytes per step: every weight the step uses is read once (embedding tables only one row
  per token), plus the whole KV cache at that context, plus the new keys/values written.

Layer schedules (the ``schedule`` slot) that loop or skip: a layer's parameters are counted once,
but its FLOPs, its KV elements and the weights a decode step reads are counted once per *visit*
(``Part.runs``): a looped layer runs (and, at these model sizes, is read from memory) again, and a
skipped layer is neither run nor read, nor counted as active. The residual stream states its cost
over the visits itself (its sites are per visit). A schedule kind may state a cost of its own (a
loop's channel between iterations) and, for layer dropout, each visit's mean probability of
running in training: training FLOPs (and MFU) count a visit by that probability, the FLOPs a run
actually spends on average; prefill and decode run every visit. A component only inference runs
(``Cost.trained`` false) counts in prefill and decode, not in training; one only training runs
(a schedule's ``training_cost``: layer dropout's early-exit readouts) in training alone.

Follower rows (the decode branch's) add rows, not weights: prefill is the primary's alone,
decode and training run ``1 + followers`` rows; followers compute no keys/values and read no
extra weights but their embedding row and the coupling vectors.

Full rows per token (Hidden Decoding's streams) are stated by the rows kind's ``per_token_parts``:
it scales each part's FLOPs and KV elements to every row a token runs (prefill, decode and
training alike), which is why they are not followers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from archlab.model import registry
from archlab.model.config import ModelConfig
from archlab.model.core.cost import Cost
from archlab.model.core.layers import Attention
from archlab.model.core.spec import base_width, layer_specs, layer_visits, visit_specs


@dataclass
class Part:
    name: str  # "embedding", "rows", "residual", "L3.attn", "L3.ffn", "L3.norms", "final_norm", "head"
    layer: int | None
    cost: Cost
    #: how many times one forward pass runs it: a layer's part once per visit of the schedule
    #: (2 for a layer a loop repeats, 0 for a skipped one); scales FLOPs, KV and decode reads
    runs: int = 1
    #: how many times a training forward runs it on average, when that is fewer (layer dropout:
    #: its visits' mean keep probabilities over the run, summed); None: ``runs``
    train_runs: float | None = None

    def training_runs(self) -> float:
        """Runs per training forward: none for a component only inference runs."""
        if not self.cost.trained:
            return 0
        return self.runs if self.train_runs is None else self.train_runs


def parts(cfg: ModelConfig) -> list[Part]:
    """Every component of ``cfg``'s model with its cost."""
    V = cfg.vocab_size
    specs = layer_specs(cfg)
    visits = layer_visits(cfg)
    d = base_width(cfg)  # the embedding's width
    final = specs[visits[-1]].d  # the unembedding's
    norm = cfg.variant("norm").load()
    ffn = cfg.variant("ffn").load()
    schedule = cfg.variant("schedule").load()
    # each visit's mean probability of running in training (layer dropout); None: always
    keep = schedule.training_keep(cfg) if hasattr(schedule, "training_keep") else None
    out = [Part("embedding", None, Cost(params=V * d, embedding=V * d))]
    out.append(Part("rows", None, cfg.variant("rows").load().cost(cfg, specs)))
    # the residual stream has two sites per visit: it is costed over the visits' specs, once
    out.append(Part("residual", None, cfg.variant("residual").load().cost(cfg, visit_specs(cfg, specs))))
    if hasattr(schedule, "cost"):  # the schedule's own components (a loop's channel)
        out.append(Part("schedule", None, schedule.cost(cfg, specs)))
    if hasattr(schedule, "training_cost"):  # what only training runs (layer dropout's exit loss)
        out.append(Part("schedule_training", None, schedule.training_cost(cfg, specs), runs=0, train_runs=1.0))
    for s in specs:
        norms = Cost(params=sum(norm.cost(cfg, site, s.d).params for site in ("attn_in", "attn_out", "mlp_in", "mlp_out")))
        runs = visits.count(s.layer)
        train = None if keep is None else sum(k for k, layer in zip(keep, visits) if layer == s.layer)
        out += [Part(f"L{s.layer}.attn", s.layer, Attention.cost(cfg, s), runs, train),
                Part(f"L{s.layer}.ffn", s.layer, ffn.cost(cfg, s), runs, train),
                Part(f"L{s.layer}.norms", s.layer, norms, runs, train)]
    out.append(Part("final_norm", None, norm.cost(cfg, "final", final)))
    head = Cost(params=0 if cfg.tie_embeddings else V * final, flops=2 * final * V,
                # a tied table is read whole as the unembedding
                decode_params=(lambda batch: V * final) if cfg.tie_embeddings else None)
    out.append(Part("head", None, head))
    # A rows kind that runs several full rows per token (Hidden Decoding's streams: each computes
    # keys/values, some layers attend across them) restates the parts' per-token work itself.
    per_token = getattr(cfg.variant("rows").load(), "per_token_parts", None)
    return out if per_token is None else per_token(cfg, out)


def followers(cfg: ModelConfig) -> int:
    """Follower rows per token (they run in training and decode, not in prefill)."""
    return registry.followers(cfg)


def param_counts(cfg: ModelConfig, ps: list[Part] | None = None) -> dict[str, int]:
    ps = ps or parts(cfg)
    cs = [p.cost for p in ps]
    return {
        "params_total": sum(c.params for c in cs),
        "params_embedding": sum(c.embedding for c in cs),
        # What a primary row touches: every weight but unused experts, follower-only tensors and
        # layers the schedule skips (a looped layer's weights count once).
        "params_active": sum(p.cost.active_params - p.cost.follower_only for p in ps if p.runs),
        "params_branch_extra": sum(c.follower_only for c in cs),
    }


# ``ps``: the config's parts when the caller has them already (``costs`` lists them once).
# ``training``: count what a training forward runs (``Part.training_runs``), on average over the run.
def _row_flops(ps: list[Part], keys: float, follower: bool, training: bool = False) -> float:
    return sum((p.training_runs() if training else p.runs) * p.cost.row_flops(keys, follower) for p in ps)


def _all_rows_flops(cfg: ModelConfig, keys: float, ps: list[Part] | None = None, training: bool = False) -> float:
    ps = ps or parts(cfg)
    return _row_flops(ps, keys, False, training) + followers(cfg) * _row_flops(ps, keys, True, training)


def prefill_flops_per_token(cfg: ModelConfig, prompt_len: int, ps: list[Part] | None = None) -> float:
    """Mean forward FLOPs per prompt token (primary rows only: followers do not run in prefill)."""
    return _row_flops(ps or parts(cfg), (prompt_len + 1) / 2, False)


def decode_flops_per_token(cfg: ModelConfig, context: int, ps: list[Part] | None = None) -> float:
    """FLOPs to produce one new token at ``context`` keys: the primary row plus follower rows."""
    return _all_rows_flops(cfg, context, ps)


def train_flops_per_token(cfg: ModelConfig, seq_len: int, ps: list[Part] | None = None) -> float:
    """The mean over the run: a visit layer dropout drops counts by its mean keep probability.
    A rows kind that attends in both directions in training (uniform diffusion) says how many
    keys a row sees (``training_keys``: all ``seq_len``); else the causal triangle's mean."""
    keys = getattr(cfg.variant("rows").load(), "training_keys", None)
    return 3 * _all_rows_flops(cfg, (seq_len + 1) / 2 if keys is None else keys(seq_len), ps, training=True)


def mfu_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """PaLM convention: 6 N (non-embedding matmul params per row) + 12 L q_dim T, over all rows
    (the blocks a training step runs, on average over the run)."""
    return 3 * _all_rows_flops(cfg, seq_len, training=True)  # non-causal attention, as the convention counts it


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2, ps: list[Part] | None = None) -> int:
    return sum(p.runs * p.cost.kv_elems for p in (ps or parts(cfg))) * dtype_bytes


def decode_bytes_per_step(cfg: ModelConfig, context: int, batch: int = 1, dtype_bytes: int = 2,
                          ps: list[Part] | None = None) -> float:
    """Bytes read (and KV written) by one decode step of ``batch`` sequences at ``context``."""
    ps = ps or parts(cfg)
    weights = sum(p.runs * p.cost.params_read_by_decode(batch) for p in ps)  # per visit
    embed_rows = batch * (1 + followers(cfg)) * base_width(cfg)
    kv = kv_bytes_per_token(cfg, dtype_bytes, ps)
    return (weights + embed_rows) * dtype_bytes + batch * context * kv + batch * kv


def per_layer(cfg: ModelConfig, context: int, dtype_bytes: int = 2) -> list[dict[str, Any]]:
    """Per layer: width, heads, parameters, visits (runs per forward pass), and the prefill/decode
    FLOPs per token and KV bytes per token of all its visits."""
    ps = parts(cfg)
    rows = []
    nf = followers(cfg)
    for s in layer_specs(cfg):
        layer = [p for p in ps if p.layer == s.layer]
        prefill = sum(p.runs * p.cost.row_flops((context + 1) / 2) for p in layer)
        decode = sum(p.runs * (p.cost.row_flops(context) + nf * p.cost.row_flops(context, True)) for p in layer)
        rows.append({"layer": s.layer, "width": s.d, "heads": s.n_heads, "kv_heads": s.n_kv_heads,
                     "head_dim": s.head_dim, "params": sum(p.cost.params for p in layer),
                     "visits": layer[0].runs,
                     "prefill_flops_per_token": prefill, "decode_flops_per_token": decode,
                     "kv_bytes_per_token": sum(p.runs * p.cost.kv_elems for p in layer) * dtype_bytes})
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
