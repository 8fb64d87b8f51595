"""Batch statistics under data parallelism.

A model statistic that is a nonlinear function of batch-wide counts (the MoE load-balancing
loss's expert shares ``f_e``) changes when each of several processes computes it over its own
slice of the batch. ``batch_sum`` sums such a count over the data-parallel ranks, so every rank
sees the statistic of the whole global batch and a run on N processes computes what one process
computes. With no group registered (one process, inference) it returns its input unchanged.

The trainer's distributed setup (``archlab.train.distributed``) registers the group; the model
never asks how it is being run.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

_GROUP: Any = None  # a torch.distributed ProcessGroup, or None for one process


def set_data_parallel_group(group: Any) -> None:
    global _GROUP
    _GROUP = group


def batch_sum(t: Tensor) -> Tensor:
    """``t`` summed over the data-parallel ranks (no gradient flows through the sum: use it for
    counts). Every rank must call it the same number of times, as every rank runs the same
    forward passes."""
    if _GROUP is None:
        return t
    # The functional collective, not dist.all_reduce: it traces under torch.compile.
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(t.detach(), "sum", _GROUP)
