"""Reference multi-head depth routing (MHAR; ``heads=1`` is AttnRes), spec section 2.

Every routing site mixes ``N`` sources ``s_i`` (each ``[M, d]``, ``M = B*T`` positions) with
weights computed from the sources themselves::

    k_i          = RMSNorm(s_i) * gain                     (RMS over the full width d)
    logit_{i,h}  = query[h] . k_i[h]                       (head slice h of width d/H)
    alpha_{i,h}  = softmax_i(logit_{i,h})
    out[h]       = sum_i alpha_{i,h} * s_i[h]              (values are the raw sources)

This module is the readable ground truth that the compiled and Triton versions are tested
against: it materialises every intermediate, computes in at least fp32 whatever the input dtype
(bf16 sources would otherwise lose the small logit differences that decide the softmax; fp64
inputs stay fp64, so the reference can be gradchecked) and lets autograd derive the backward.
"""

from __future__ import annotations

import torch


def validate_route_args(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor,
                        heads: int, tail: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming the first shape mismatch among the routing inputs.

    Shared by every implementation so that a bad call fails the same way whichever one runs.
    """
    if sources.dim() != 3:
        raise ValueError(f"sources must be [N, M, d], got shape {tuple(sources.shape)}")
    n, _, d = sources.shape
    if n < 1:
        raise ValueError("routing needs at least one source (N >= 1)")
    if query.shape != (d,) or gain.shape != (d,):
        raise ValueError(f"query and gain must be [{d}], got {tuple(query.shape)} and "
                         f"{tuple(gain.shape)}")
    if heads < 1 or d % heads != 0:
        raise ValueError(f"heads={heads} must be a positive divisor of the width d={d}")
    if not (sources.is_floating_point() and query.is_floating_point()
            and gain.is_floating_point()):
        raise ValueError("sources, query and gain must be floating point")
    validate_tail(sources, tail)


def validate_tail(sources: torch.Tensor, tail: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless ``tail`` (if any) is one more source: [M, d], the sources' dtype."""
    if tail is not None and (tail.shape != sources.shape[1:] or tail.dtype != sources.dtype):
        raise ValueError(f"tail must be one more source, {tuple(sources.shape[1:])} {sources.dtype}; "
                         f"got {tuple(tail.shape)} {tail.dtype}")


def route_reference(sources: torch.Tensor, query: torch.Tensor, gain: torch.Tensor, heads: int,
                    eps: float, return_weights: bool = False,
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Route ``sources`` [N, M, d] into ``out`` [M, d] (input dtype), step by step in fp32.

    With ``return_weights`` also returns the routing weights ``alpha`` [N, M, H] (fp32, or fp64
    for fp64 sources); they stay attached to the autograd graph here, so a loss on them is
    differentiable.
    """
    validate_route_args(sources, query, gain, heads)
    n, m, d = sources.shape
    compute = torch.promote_types(sources.dtype, torch.float32)
    s = sources.to(compute)
    # RMSNorm over the full width first, then slice into heads (MHAR's definition).
    inv_rms = torch.rsqrt(s.square().mean(dim=-1, keepdim=True) + eps)
    keys = s * inv_rms * gain.to(compute)
    logits = (keys * query.to(compute)).unflatten(-1, (heads, d // heads)).sum(dim=-1)  # [N, M, H]
    weights = torch.softmax(logits, dim=0)
    values = s.unflatten(-1, (heads, d // heads))  # [N, M, H, d/H]
    out = (weights.unsqueeze(-1) * values).sum(dim=0).reshape(m, d).to(sources.dtype)
    if return_weights:
        return out, weights
    return out
