"""The readout's linear layer and its loss in one autograd step that never holds the logits.

``F.cross_entropy(hidden @ weight.T, targets)`` keeps the [N, V] logits for the backward, in
the autocast dtype and again in float32 (the loss upcasts them): at 32 x 1024 tokens and V =
50,304 that is 3.3 GB + 6.6 GB per micro-batch, more than the rest of a 124m model's
activations. Every loss archlab trains on reads the logits only through a few per-row
reductions over the vocabulary, so ``linear_readout_stats`` computes just those, over chunks of
rows, for logits ``z = hidden @ weight.T``:

* ``lse = logsumexp(z)`` and ``picked = z[target]``: the cross-entropy is ``lse - picked``;
* optionally the log collision probability ``log sum_v p_v^2 = logsumexp(2 (z - lse))``, which
  gates the decode branch's mixture readout (computed from the shifted logits, not as
  ``logsumexp(2z) - 2 lse``: the difference of two large log-sum-exps loses float32 precision).

The forward keeps 4 bytes per row and statistic and nothing of size V. The backward computes
each chunk's logits again and multiplies ``dloss/dz = g_lse p + 2 g_col (q - p) + g_picked
onehot(target)`` (``p = softmax(z)``, ``q = softmax(2z)``) straight into the two gradients. It costs one more
[chunk, d] x [d, V] product per chunk (the recomputation) and saves the [N, V] tensors' traffic.
What the loss does with the statistics (a mean, a mixture) is ordinary autograd on [N] tensors.

Numerics follow the unfused path: the product runs in the autocast dtype when autocast is on
(as ``nn.Linear`` would), the reductions in float32 (float64 for float64 inputs). The gradients
are the unfused ones' up to summation order.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100  # F.cross_entropy's default: such targets count in neither the sum nor the mean
DEFAULT_CHUNK = 4096  # rows per chunk: a [4096, 50304] float32 block is 0.8 GB


def _product_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``hidden @ weight.T`` has under the current autocast state."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _ReadoutStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, squared: bool,
                chunk: int) -> tuple[Tensor, Tensor, Tensor]:
        dtype = _product_dtype(hidden, weight)
        acc = torch.promote_types(dtype, torch.float32)
        h, w = hidden.to(dtype), weight.to(dtype)
        n = hidden.shape[0]
        lse = torch.empty(n, device=hidden.device, dtype=acc)
        picked = torch.empty(n, device=hidden.device, dtype=acc)
        col = torch.empty(n if squared else 0, device=hidden.device, dtype=acc)
        safe = targets.clamp_min(0)
        with torch.autocast(hidden.device.type, enabled=False):  # the product's dtype is chosen above
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                logits = (h[start:end] @ w.T).to(acc)
                lse[start:end] = logits.logsumexp(-1)
                picked[start:end] = logits.gather(1, safe[start:end, None])[:, 0]
                if squared:
                    col[start:end] = (2 * (logits - lse[start:end, None])).logsumexp(-1)
        ctx.save_for_backward(hidden, weight, safe, lse, col)
        ctx.dtype, ctx.squared, ctx.chunk = dtype, squared, chunk
        ctx.mark_non_differentiable(*(() if squared else (col,)))
        return lse, picked, col

    @staticmethod
    def backward(ctx, g_lse: Tensor | None, g_picked: Tensor | None, g_col: Tensor | None):
        hidden, weight, safe, lse, col = ctx.saved_tensors
        dtype, chunk, acc = ctx.dtype, ctx.chunk, lse.dtype
        h, w = hidden.to(dtype), weight.to(dtype)
        n = hidden.shape[0]
        zero = torch.zeros(n, device=hidden.device, dtype=acc)
        g_lse = zero if g_lse is None else g_lse.to(acc)
        g_picked = zero if g_picked is None else g_picked.to(acc)
        g_col = None if not ctx.squared or g_col is None else g_col.to(acc)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=acc)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk):
                end = min(start + chunk, n)
                rows = slice(start, end)
                logits = (h[rows] @ w.T).to(acc)
                shifted = logits - lse[rows, None]  # log p
                if g_col is None:
                    g = torch.exp(shifted) * g_lse[rows, None]
                else:
                    g = torch.exp(shifted) * (g_lse - 2 * g_col)[rows, None]
                    g += torch.exp(2 * shifted - col[rows, None]) * (2 * g_col[rows, None])  # q = softmax(2z)
                g.scatter_add_(1, safe[rows, None], g_picked[rows, None])
                g = g.to(dtype)
                grad_hidden[rows] = (g @ w).to(hidden.dtype)
                grad_weight += (g.T @ h[rows]).to(acc)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def linear_readout_stats(hidden: Tensor, weight: Tensor, targets: Tensor, squared: bool = False,
                         chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per row of ``hidden`` [N, d], with logits ``z = hidden @ weight.T`` ([V, d] weight):
    ``(logsumexp(z), z[target], log sum_v softmax(z)_v^2 if squared else None)``, each [N],
    differentiable in ``hidden`` and ``weight``; at most one [chunk, V] block of logits exists at
    a time. A target of ``IGNORE_INDEX`` reads entry 0 (the caller masks that row)."""
    if hidden.dim() != 2 or weight.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"the readout takes hidden [N, d], weight [V, d], targets [N]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    lse, picked, collision = _ReadoutStats.apply(hidden, weight, targets, squared, chunk)
    return lse, picked, collision if squared else None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int = DEFAULT_CHUNK) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets)``: the mean over targets other than
    ``IGNORE_INDEX``, for ``hidden`` [N, d], ``weight`` [V, d], ``targets`` [N], without an
    [N, V] tensor kept for the backward."""
    lse, picked, _ = linear_readout_stats(hidden, weight, targets, chunk=chunk)
    valid = targets != IGNORE_INDEX
    return torch.where(valid, lse - picked, 0.0).sum() / valid.sum().clamp_min(1)
