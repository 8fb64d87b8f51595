"""DiscoLoop's discrete channel between loop iterations (arXiv 2607.00341).

    Phi(h)  = sum_v softmax(W h / tau)_v W[v]        W: the tied embedding table [V, d]
    h_tilde = h + alpha * RMSNorm(Phi(h))

The next iteration runs on ``h_tilde``. ``Phi`` snaps the hidden state towards the embeddings of
the tokens it predicts, so what one iteration hands the next is (softly) a token. The RMSNorm has
no gain (the paper writes none; ``alpha`` is the scale). ``alpha`` is fixed, or learned per token
as ``2 alpha sigmoid(w . RMSNorm(h) + b)`` with ``w`` and ``b`` zero at initialisation, so a
learned gate starts exactly at ``alpha`` and can move it within ``(0, 2 alpha)``.

Memory: the probabilities are [tokens, V]; autograd keeps them (and the matmul keeps them again as
its input) for backward. ``chunk_tokens`` computes the channel over chunks of tokens, each under
activation checkpointing, so only a chunk's probabilities exist at once and backward recomputes
them (one more ``4 V d`` per token). No fused kernel: it is two matmuls and a softmax, which
cuBLAS and the softmax kernel already run near their limits; the chunking is the memory knob.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from archlab.model.core.spec import base_width

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.init import Init


def rms_normalise(x: Tensor, eps: float) -> Tensor:
    """``x / rms(x)`` without a gain, computed in at least fp32 (bf16 sums of squares lose too much)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def vocabulary_mixture(h: Tensor, table: Tensor, tau: float) -> Tensor:
    """``softmax(h W^T / tau) W`` for rows ``h`` [N, d] and table ``W`` [V, d]; the softmax in at
    least fp32 (under autocast the two products run in bf16)."""
    logits = h @ table.t()
    probs = torch.softmax(logits / tau, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    return probs.to(logits.dtype) @ table


class DiscreteChannel(nn.Module):
    """The channel, applied by the decoder to the residual state before each visit in ``before``
    (the first visit of loop iterations 2..K): ``forward(h, visit, model)`` reads the table from
    ``model.tok_emb`` (tied to the unembedding, so it is the paper's W)."""

    def __init__(self, cfg: "ModelConfig", before: list[int]):
        super().__init__()
        o = cfg.looped
        self.before = frozenset(before)
        self.tau, self.alpha, self.eps = o.tau, o.alpha, cfg.norm_eps
        self.realign = o.realign
        self.chunk_tokens = o.chunk_tokens
        # One gate for every boundary: the loop's weights are shared across iterations, so is it.
        # Plain zero parameters, not an nn.Linear, whose default init would draw from the RNG and
        # shift every draw after it.
        learned = o.alpha_mode == "learned"
        self.gate_weight = nn.Parameter(torch.zeros(base_width(cfg))) if learned else None
        self.gate_bias = nn.Parameter(torch.zeros(())) if learned else None

    def init_parameters(self, init: "Init") -> None:
        if self.gate_weight is not None:
            with torch.no_grad():  # the gate starts at exactly alpha for every token
                self.gate_weight.zero_()
                self.gate_bias.zero_()

    def extra_repr(self) -> str:
        mode = "learned" if self.gate_weight is not None else "fixed"
        return (f"before visits {sorted(self.before)}, tau={self.tau:g}, alpha={self.alpha:g} ({mode})"
                + (", realign" if self.realign else ""))

    def mix(self, h: Tensor, table: Tensor) -> Tensor:
        """``Phi(h)`` for ``h`` [..., d], over chunks of ``chunk_tokens`` rows when set."""
        rows = h.reshape(-1, h.shape[-1])
        n = self.chunk_tokens
        if n <= 0 or rows.shape[0] <= n:
            return vocabulary_mixture(rows, table, self.tau).view(h.shape)
        recompute = torch.is_grad_enabled()
        chunks = [checkpoint(vocabulary_mixture, c, table, self.tau, use_reentrant=False) if recompute
                  else vocabulary_mixture(c, table, self.tau) for c in rows.split(n)]
        return torch.cat(chunks).view(h.shape)

    def gate_value(self, h: Tensor) -> Tensor | float:
        """``alpha``, or the learned gate's per-token value [..., 1]."""
        if self.gate_weight is None:
            return self.alpha
        logit = rms_normalise(h, self.eps) @ self.gate_weight.to(h.dtype)[:, None] + self.gate_bias.to(h.dtype)
        return 2 * self.alpha * torch.sigmoid(logit)

    def transform(self, h: Tensor, table: Tensor) -> Tensor:
        """``h + alpha RMSNorm(Phi(h))``."""
        return h + self.gate_value(h) * rms_normalise(self.mix(h, table), self.eps).to(h.dtype)

    def forward(self, h: Tensor, visit: int, model: nn.Module) -> Tensor:
        if self.realign and self.training:  # realignment: a plain loop in training
            return h
        return self.transform(h, model.tok_emb.weight)
