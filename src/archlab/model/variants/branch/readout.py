"""The decode branch's readouts: branch-only, or the confidence-gated mixture (spec section 1).

``p = softmax(primary logits)``, ``q = mean over branches of softmax(branch logits)``,
``alpha = clamp(sum_v p_v^2, alpha_min, alpha_max)`` (the primary's collision probability), the
prediction ``alpha p + (1 - alpha) q``, computed in log space in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from archlab.model.variants.branch import BranchConfig


def log_collision(logp: Tensor) -> Tensor:
    """``log sum_v p_v^2`` from the primary's log-probabilities [..., V], computed as
    ``logsumexp(2 log p)`` (from log-probabilities, not raw logits: subtracting two large
    log-sum-exps loses fp32 precision)."""
    return torch.logsumexp(2 * logp, dim=-1)


def _alpha_logs(collision: Tensor, br: BranchConfig) -> tuple[Tensor, Tensor]:
    """log(alpha) and log(1 - alpha) from the primary's ``log_collision``.

    ``log(1 - alpha)`` is floored at the smallest normal float so that alpha = 1 gives a finite
    value and a zero (not NaN) gradient; the floor changes the mixture by under 1e-38.
    """
    alpha = torch.exp(collision).clamp(br.alpha_min, br.alpha_max)
    if br.detach_alpha:
        alpha = alpha.detach()
    tiny = torch.finfo(torch.float32).tiny
    return torch.log(alpha.clamp_min(tiny)), torch.log((1 - alpha).clamp_min(tiny))


def mean_branches(logq: Tensor) -> Tensor:
    """log of the mean of the branches' distributions (branch axis first)."""
    if logq.shape[0] == 1:
        return logq[0]
    return torch.logsumexp(logq, dim=0) - math.log(logq.shape[0])


def mixture_log_probs(primary_logits: Tensor, branch_logits: Tensor, br: BranchConfig) -> Tensor:
    """log(alpha * p + (1 - alpha) * mean_r q_r) over the vocabulary, in fp32 (for decoding)."""
    logp = F.log_softmax(primary_logits.float(), dim=-1)
    log_a, log_1ma = _alpha_logs(log_collision(logp), br)
    logq = mean_branches(F.log_softmax(branch_logits.float(), dim=-1))
    return torch.logaddexp(log_a[..., None] + logp, log_1ma[..., None] + logq)


def mixture_nll(primary_logits: Tensor, branch_logits: Tensor, targets: Tensor, br: BranchConfig) -> Tensor:
    """Mean -log(alpha p_y + (1 - alpha) q_y): ``mixture_log_probs`` at the targets, but mixing
    only the gathered target entries, so that far fewer fp32 [B, T, V] tensors are kept for the
    backward pass (they dominate the training memory)."""
    logp = F.log_softmax(primary_logits.float(), dim=-1)
    logp_y = logp.gather(-1, targets[..., None]).squeeze(-1)
    bl = branch_logits.float()
    idx = targets[None, ..., None].expand(bl.shape[0], *targets.shape, 1)
    return mixture_nll_of(logp_y, log_collision(logp), bl.gather(-1, idx).squeeze(-1) - torch.logsumexp(bl, dim=-1), br)


def mixture_nll_of(logp_y: Tensor, collision: Tensor, logq_y: Tensor, br: BranchConfig) -> Tensor:
    """The mixture's mean NLL from per-token statistics alone: the primary's log-probability of
    the target ``logp_y`` and its ``log_collision`` [...], each branch's log-probability of the
    target ``logq_y`` [n_branches, ...] (what the fused readout computes without the logits)."""
    log_a, log_1ma = _alpha_logs(collision, br)
    return -torch.logaddexp(log_a + logp_y, log_1ma + mean_branches(logq_y)).mean()


def readout_log_probs(primary_logits: Tensor, branch_logits: Tensor | None, br: BranchConfig) -> Tensor:
    """Log-probabilities of the prediction: primary (no branch rows), branch-only or the mixture."""
    if branch_logits is None:
        return F.log_softmax(primary_logits.float(), dim=-1)
    if br.readout == "branch":
        return mean_branches(F.log_softmax(branch_logits.float(), dim=-1))
    return mixture_log_probs(primary_logits, branch_logits, br)


def readout_nll(primary_logits: Tensor, branch_logits: Tensor | None, targets: Tensor, br: BranchConfig) -> Tensor:
    if branch_logits is None:
        return F.cross_entropy(primary_logits.float().flatten(0, 1), targets.flatten())
    if br.readout == "mixture":
        return mixture_nll(primary_logits, branch_logits, targets, br)
    logprobs = readout_log_probs(primary_logits, branch_logits, br)
    return -logprobs.gather(-1, targets[..., None]).mean()
