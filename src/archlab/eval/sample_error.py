"""The sampling error of a loss measured on a fixed sample of validation batches (torch-free: the
trainer's final evaluation computes it, the lab's report reads it back).

The batches of a final evaluation are disjoint runs of the validation split, so their losses are
treated as draws: the error of the token-weighted mean over them is the ratio estimator's. The
same formula on the per-batch *differences* of two models scored on the same batches is the error
that the finite sample adds to a paired comparison, which is what a verdict has to beat; on a
corpus that mixes sources the first is large (batches of dictionary text and of source code
differ by nats) and the second small (both models find the same batches hard).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def sampling_se(nats: Sequence[float], tokens: Sequence[float]) -> float | None:
    """Standard error of the token-weighted mean loss ``sum(nats) / sum(tokens)`` over batches
    (the ratio estimator's: ``sqrt(n / (n - 1) * sum(w_i^2 (l_i - mean)^2)) / sum(w_i)`` with
    ``l_i`` a batch's mean loss and ``w_i`` its tokens); None below two batches. Given the
    per-batch differences of two models' nats on the same batches, it is the sampling error of
    the difference of their losses: the part of a paired comparison the sample contributes."""
    n = len(tokens)
    if n < 2:
        return None
    total = sum(tokens)
    mean = sum(nats) / total
    spread = sum((a - mean * w) ** 2 for a, w in zip(nats, tokens))  # w^2 (l - mean)^2, l = a / w
    return math.sqrt(n / (n - 1) * spread) / total


def paired_sampling_se(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float | None:
    """The sampling error of ``loss(a) - loss(b)`` for two models' per-batch ``[nats, tokens]`` on
    the same batches; None when they were not scored on the same batches."""
    if len(a) != len(b) or any(x[1] != y[1] for x, y in zip(a, b)):
        return None
    return sampling_se([x[0] - y[0] for x, y in zip(a, b)], [x[1] for x in a])
