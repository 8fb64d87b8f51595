"""The ``rows`` slot: which rows a token runs through the layers, and the readout of their logits.

The core kind, ``primary``, runs one row per token (the baseline) and reads out
``softmax(logits)``. A rows kind (the decode branch, ``archlab.model.variants.branch``) adds
follower rows and owns everything about them: their embeddings (``attach_embeddings``), their
per-layer parameters (``attach_block``), how the passes over the layers are arranged in training,
prefill and decode, and the readout. Every consumer of a model's predictions (generation,
evaluation, conversion checks, the engine) calls ``log_probs``/``nll`` and never sees the rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from archlab.kernels.linear_cross_entropy import linear_cross_entropy
from archlab.model.core.context import Context
from archlab.model.core.cost import Cost

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.decoder import Block, Transformer
    from archlab.model.core.init import Init
    from archlab.model.core.spec import LayerSpec


def run_layers(model: "Transformer", x: Tensor, ctx: Context, exit_after: int | None) -> Tensor:
    """``model.run(x, ctx)``, handing ``exit_after`` on only when an early exit is asked for, so
    that a wrapper of ``run`` written for its two arguments (a test's call counter) keeps working."""
    return model.run(x, ctx) if exit_after is None else model.run(x, ctx, exit_after)


def last_of(x: Tensor, lengths: Tensor) -> Tensor:
    """``x[b, lengths[b] - 1]`` for every row of ``x`` [B, T, ...], as [B, 1, ...]."""
    return x[torch.arange(x.shape[0], device=x.device), lengths - 1][:, None]


class PrimaryRows(nn.Module):
    """One row per token; the prediction is the softmax of its logits."""

    #: whether ``train.fused_readout`` left at auto computes the training loss from per-token
    #: statistics (``fused_nll``) rather than from kept logits: not for one readout, where the
    #: H200 measured no smaller peak and 0.97x the tokens/s at 124m (docs/benchmarks.md)
    fused_readout_by_default = False

    def __init__(self, cfg: "ModelConfig"):
        super().__init__()
        self.cfg = cfg

    # ---- building -------------------------------------------------------------------------------
    def attach_embeddings(self, model: "Transformer") -> None:
        """Add embedding tables to ``model`` (called right after the token embedding)."""

    def attach_block(self, block: "Block", spec: "LayerSpec") -> None:
        """Add per-layer parameters to ``block`` (called after it is built)."""

    def init_parameters(self, model: "Transformer", init: "Init") -> None:
        """Initialise what ``attach_embeddings`` added (``attach_block``'s: through the block)."""

    @classmethod
    def cost(cls, cfg: "ModelConfig", specs: "list[LayerSpec]") -> Cost:
        return Cost()

    def cache_batch(self, sequences: int) -> int:
        """KV-cache rows for ``sequences`` sequences: one each (their rows' keys/values)."""
        return sequences

    # ---- running --------------------------------------------------------------------------------
    # ``exit_after`` (early exit): every run over the layers stops after that many visits.
    def forward(self, model: "Transformer", idx: Tensor, ctx: Context, followers: bool = True,
                exit_after: int | None = None) -> tuple[Tensor, Tensor | None]:
        """(primary logits [B, T, V], extra logits or None) of a full causal forward."""
        return model.logits(run_layers(model, model.tok_emb(idx), ctx, exit_after)), None

    def prefill(self, model: "Transformer", idx: Tensor, ctx: Context, lengths: Tensor,
                exit_after: int | None = None) -> Tensor:
        """Run prompts (writing the cache); log-probabilities of each one's next token [B, V]."""
        hidden = run_layers(model, model.tok_emb(idx), ctx, exit_after)
        return self.log_probs(model.logits(last_of(hidden, lengths)), None)[:, 0]

    def decode(self, model: "Transformer", idx: Tensor, ctx: Context, exit_after: int | None = None) -> Tensor:
        """One token per sequence ([B, 1]); log-probabilities of the next token [B, V]."""
        hidden = run_layers(model, model.tok_emb(idx), ctx, exit_after)
        return self.log_probs(model.logits(hidden), None)[:, 0]

    # ---- the readout ----------------------------------------------------------------------------
    def log_probs(self, logits: Tensor, extra: Tensor | None) -> Tensor:
        return F.log_softmax(logits.float(), dim=-1)

    def nll(self, logits: Tensor, extra: Tensor | None, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def fused_nll(self, model: "Transformer", idx: Tensor, targets: Tensor, ctx: Context,
                  exit_after: int | None) -> Tensor | None:
        """``nll`` of the full forward without the logits kept (``kernels.linear_cross_entropy``),
        or None where that is not this kind's loss: only a kind whose forward and readout are
        these plain ones fuses (a subclass that changes either gets None, and the caller reads
        out as usual)."""
        kind = type(self)
        if kind.forward is not PrimaryRows.forward or kind.nll is not PrimaryRows.nll:
            return None
        hidden = run_layers(model, model.tok_emb(idx), ctx, exit_after)
        return linear_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, targets.flatten())
