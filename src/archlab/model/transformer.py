"""The one model: a pre-norm Llama-style decoder whose variants are options, not copies.

    x = E1[idx]
    for each layer:  x = x + Attn(RMSNorm(x));  x = x + MLP(RMSNorm(x))     (residual stream)
    logits = W_out RMSNorm(x)

Options plug in at fixed points: the residual stream (``residual.py``: standard, attnres, delta),
the FFN type (``ffn.py``: swiglu, moe), per-layer head schedules (``ModelConfig.heads_at``) and the
decode branch: extra rows per token that share every weight but the embedding, query the primary's
keys/values and never write any (spec section 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from archlab.config import ModelConfig
from archlab.model.ffn import build_ffn
from archlab.model.layers import (AttnContext, Attention, CouplingStash, Groups, KVCache, QueryCoupling,
                                  RMSNorm, VectorCoupling, project, rope_tables)
from archlab.model.residual import build_residual


@dataclass
class ModelOutput:
    logits: Tensor  # primary logits [B, T, V]
    branch_logits: Tensor | None = None  # [n_branches, B, T, V]
    loss: Tensor | None = None  # training objective (NLL + auxiliary losses)
    nll: Tensor | None = None  # the readout's negative log-likelihood alone
    aux_loss: Tensor | None = None


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        n_heads, n_kv, head_dim = cfg.heads_at(layer)
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, n_heads, n_kv, head_dim)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = build_ffn(cfg)
        br = cfg.branch
        self.coupled = br.enabled and br.coupling
        if self.coupled:
            self.couple_q = QueryCoupling(br.n_branches, n_heads * head_dim)
            self.couple_u = (VectorCoupling(br.n_branches, self.mlp.coupling_hidden)
                             if self.mlp.coupling_hidden else None)
            self.couple_m = VectorCoupling(br.n_branches, cfg.d_model)

    def attention(self, hs: Groups, ctx: AttnContext, fuse: bool) -> Groups:
        normed = [self.attn_norm(h) if h is not None else None for h in hs]
        return self.attn(normed, ctx, self.layer, fuse, self.couple_q if self.coupled else None)

    def feed_forward(self, hs: Groups, ctx: AttnContext, fuse: bool) -> Groups:
        normed = [self.mlp_norm(h) if h is not None else None for h in hs]
        outs = self.mlp(normed, ctx, self.layer, fuse, self.couple_u if self.coupled else None)
        if hs[0] is not None and ctx.stash is not None:
            ctx.stash.put(self.layer, "m", outs[0])
        if self.coupled and len(outs) > 1 and outs[1] is not None:
            src = outs[0] if outs[0] is not None else ctx.stash.get(self.layer, "m")
            outs[1] = self.couple_m(src, outs[1])
        return outs


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        br = cfg.branch
        self.n_branches = br.n_branches if br.enabled else 0
        if self.n_branches:
            # E2: one table per branch, stacked [n_branches * V, d].
            self.branch_emb = nn.Embedding(self.n_branches * cfg.vocab_size, cfg.d_model)
        self.residual = build_residual(cfg)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.head_dims = sorted({cfg.heads_at(i)[2] for i in range(cfg.n_layers)})
        # RoPE cos/sin for every position up to max_seq_len, computed once. Computed inside the
        # forward instead, torch.compile fuses the arange/pow/cos/sin into every rotation kernel
        # and evaluates the transcendentals per element of q and k, in forward and backward:
        # about a quarter of a 124m training step on an H200 (docs/benchmarks.md).
        positions = torch.arange(cfg.max_seq_len)
        for hd in self.head_dims:
            cos, sin = rope_tables(hd, positions, cfg.rope_theta)
            self.register_buffer(f"rope_cos_{hd}", cos, persistent=False)
            self.register_buffer(f"rope_sin_{hd}", sin, persistent=False)
        self.reset_parameters()

    # ---- initialisation ----------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Normal(0, init_std) for linear and embedding weights; sublayer output projections
        scaled by 1/sqrt(2L) (GPT-2) so the residual stream's variance does not grow with depth.
        Other modules (coupling vectors, routing queries, experts) initialise their own
        parameters through ``init_weights(std, out_std)`` when they define it."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scaled = name.endswith(("attn.wo", "w_down"))
                nn.init.normal_(module.weight, 0.0, out_std if scaled else std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif module is not self and hasattr(module, "init_weights"):
                module.init_weights(std, out_std)

    # ---- the layer loop ------------------------------------------------------------------------
    def _run(self, xs: Groups, ctx: AttnContext, fuse: bool) -> Groups:
        states = [self.residual.start(x) if x is not None else None for x in xs]
        for block in self.layers:
            site = 2 * block.layer
            outs = block.attention([self.residual.read(s, site) if s is not None else None for s in states],
                                   ctx, fuse)
            states = [self.residual.write(s, site, o) if s is not None else None for s, o in zip(states, outs)]
            outs = block.feed_forward([self.residual.read(s, site + 1) if s is not None else None
                                       for s in states], ctx, fuse)
            states = [self.residual.write(s, site + 1, o) if s is not None else None
                      for s, o in zip(states, outs)]
        finals = [self.norm(self.residual.final(s)) if s is not None else None for s in states]
        return project(self.lm_head, finals, fuse)

    def _embed_branch(self, idx: Tensor) -> Tensor:
        """Branch rows for tokens ``idx`` [B, T]: [n_branches * B, T, d], branch-major."""
        offsets = torch.arange(self.n_branches, device=idx.device) * self.cfg.vocab_size
        return self.branch_emb((idx[None] + offsets[:, None, None]).flatten(0, 1))

    def _rope(self, positions: Tensor | int) -> dict[int, tuple[Tensor, Tensor]]:
        """cos/sin per head dim: for positions ``0..positions-1`` (an int) or at the given
        positions (a tensor, each below ``max_seq_len``)."""
        tables = {hd: (getattr(self, f"rope_cos_{hd}"), getattr(self, f"rope_sin_{hd}")) for hd in self.head_dims}
        if isinstance(positions, int):
            if positions > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {positions} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}")
            return {hd: (cos[:positions], sin[:positions]) for hd, (cos, sin) in tables.items()}
        return {hd: (cos[positions], sin[positions]) for hd, (cos, sin) in tables.items()}

    def _aux_loss(self) -> Tensor | None:
        losses = [b.mlp.aux_loss for b in self.layers if b.mlp.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    # ---- training / evaluation ----------------------------------------------------------------
    def forward(self, idx: Tensor, targets: Tensor | None = None, with_branch: bool = True) -> ModelOutput:
        """Full causal forward over [B, T] tokens; with targets, the readout's loss."""
        b, t = idx.shape
        ctx = AttnContext(rope=self._rope(t))
        xs: Groups = [self.tok_emb(idx)]
        if self.n_branches and with_branch:
            xs.append(self._embed_branch(idx))
        logits = self._run(xs, ctx, fuse=False)
        out = ModelOutput(logits=logits[0])
        if len(logits) > 1:
            out.branch_logits = logits[1].view(self.n_branches, b, t, -1)
        aux = self._aux_loss()
        out.aux_loss = aux
        if targets is not None:
            out.nll = readout_nll(out.logits, out.branch_logits, targets, self.cfg)
            out.loss = out.nll if aux is None else out.nll + aux
        return out

    # ---- cached inference ---------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> KVCache:
        shapes = [(blk.attn.n_kv_heads, blk.attn.head_dim) for blk in self.layers]
        ref = self.lm_head.weight
        return KVCache(shapes, batch, max_len, device or ref.device, dtype or ref.dtype)

    def forward_cached(self, idx: Tensor | None, cache: KVCache, input_pos: Tensor, rope_pos: Tensor,
                       key_valid: Tensor, branch_idx: Tensor | None = None,
                       stash: CouplingStash | None = None, fuse: bool = True) -> Groups:
        """One cached step over new tokens.

        ``idx`` [B, T]: primary tokens written to the cache at slots ``input_pos`` [T] (``None``:
        branch-only step, reading ``stash``); ``rope_pos`` [B, T] their positions; ``key_valid``
        [B, S] marks cache slots holding real tokens (left padding is False); ``branch_idx``
        [B, T]: tokens whose branch rows to run (no cache writes). Returns [primary logits,
        branch logits [n_branches * B, T, V]] (entries ``None`` when not run).
        """
        slots = torch.arange(cache.max_len, device=input_pos.device)
        causal = slots[None, :] <= input_pos[:, None]  # [T, S]
        own = slots[None, :] == input_pos[:, None]  # a padded query still sees itself: no empty rows
        mask = (causal[None] & key_valid[:, None, :]) | own[None]
        ctx = AttnContext(rope=self._rope(rope_pos), cache=cache, input_pos=input_pos, mask=mask[:, None],
                          stash=stash)
        xs: Groups = [self.tok_emb(idx) if idx is not None else None]
        if branch_idx is not None:
            xs.append(self._embed_branch(branch_idx))
        return self._run(xs, ctx, fuse)


# ---- readouts ----------------------------------------------------------------------------------
def _alpha_logs(logp: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    """log(alpha) and log(1 - alpha) from the primary's log-probabilities [..., V].

    ``alpha = clamp(sum_v p_v^2, alpha_min, alpha_max)`` is the primary's collision probability,
    computed as ``exp(logsumexp(2 log p))`` (from log-probabilities, not raw logits: subtracting
    two large log-sum-exps loses fp32 precision). ``log(1 - alpha)`` is floored at the smallest
    normal float so that alpha = 1 gives a finite value and a zero (not NaN) gradient; the floor
    changes the mixture by under 1e-38.
    """
    br = cfg.branch
    alpha = torch.exp(torch.logsumexp(2 * logp, dim=-1)).clamp(br.alpha_min, br.alpha_max)
    if br.detach_alpha:
        alpha = alpha.detach()
    tiny = torch.finfo(torch.float32).tiny
    return torch.log(alpha.clamp_min(tiny)), torch.log((1 - alpha).clamp_min(tiny))


def _mean_branches(logq: Tensor) -> Tensor:
    """log of the mean of the branches' distributions (branch axis first)."""
    if logq.shape[0] == 1:
        return logq[0]
    return torch.logsumexp(logq, dim=0) - math.log(logq.shape[0])


def mixture_log_probs(primary_logits: Tensor, branch_logits: Tensor, cfg: ModelConfig) -> Tensor:
    """log(alpha * p + (1 - alpha) * mean_r q_r) over the vocabulary, in fp32 (for decoding)."""
    logp = F.log_softmax(primary_logits.float(), dim=-1)
    log_a, log_1ma = _alpha_logs(logp, cfg)
    logq = _mean_branches(F.log_softmax(branch_logits.float(), dim=-1))
    return torch.logaddexp(log_a[..., None] + logp, log_1ma[..., None] + logq)


def mixture_nll(primary_logits: Tensor, branch_logits: Tensor, targets: Tensor, cfg: ModelConfig) -> Tensor:
    """Mean -log(alpha p_y + (1 - alpha) q_y): ``mixture_log_probs`` at the targets, but mixing
    only the gathered target entries, so that far fewer fp32 [B, T, V] tensors are kept for the
    backward pass (they dominate the training memory)."""
    logp = F.log_softmax(primary_logits.float(), dim=-1)
    log_a, log_1ma = _alpha_logs(logp, cfg)
    logp_y = logp.gather(-1, targets[..., None]).squeeze(-1)
    bl = branch_logits.float()
    idx = targets[None, ..., None].expand(bl.shape[0], *targets.shape, 1)
    logq_y = _mean_branches(bl.gather(-1, idx).squeeze(-1) - torch.logsumexp(bl, dim=-1))
    return -torch.logaddexp(log_a + logp_y, log_1ma + logq_y).mean()


def readout_log_probs(primary_logits: Tensor, branch_logits: Tensor | None, cfg: ModelConfig) -> Tensor:
    """Log-probabilities of the model's prediction: primary, branch-only or the mixture."""
    if branch_logits is None:
        return F.log_softmax(primary_logits.float(), dim=-1)
    if cfg.branch.readout == "branch":
        return _mean_branches(F.log_softmax(branch_logits.float(), dim=-1))
    return mixture_log_probs(primary_logits, branch_logits, cfg)


def readout_nll(primary_logits: Tensor, branch_logits: Tensor | None, targets: Tensor,
                cfg: ModelConfig) -> Tensor:
    if branch_logits is None:
        return F.cross_entropy(primary_logits.float().flatten(0, 1), targets.flatten())
    if cfg.branch.readout == "mixture":
        return mixture_nll(primary_logits, branch_logits, targets, cfg)
    logprobs = readout_log_probs(primary_logits, branch_logits, cfg)
    return -logprobs.gather(-1, targets[..., None]).mean()
