"""What a component costs, stated by the component itself (``cost(...)`` classmethods).

``archlab.model.accounting`` only sums these. The conventions (one matrix-vector product by an
``m x n`` weight costs ``2 m n`` FLOPs; norms, activations, softmaxes and RoPE are not counted) are
stated there once. *Follower* rows are the extra rows of the ``rows`` slot (decode-branch rows):
they share the weights, compute no keys/values and are counted apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Cost:
    params: int = 0  # parameters this component owns
    #: of which one primary row touches (None: all); unused experts and follower-only tensors are not
    active: int | None = None
    follower_only: int = 0  # of ``params``, tensors only follower rows read (branch embedding, coupling)
    embedding: int = 0  # of ``params``, lookup tables (a token reads one row)
    flops: float = 0.0  # forward FLOPs of one primary row, attention scores excluded
    flops_follower: float | None = None  # the same for one follower row (None: ``flops``)
    score_flops_per_key: float = 0.0  # attention: FLOPs per key attended, per row (4 * q_dim)
    kv_elems: int = 0  # key and value elements one token writes to the cache
    #: parameters a decode step of ``batch`` sequences reads (None: every non-embedding parameter)
    decode_params: Callable[[int], int] | None = field(default=None, repr=False)
    #: whether training runs it: False for a component only inference runs (DiscoLoop's
    #: realignment), whose FLOPs count in prefill and decode but not in training
    trained: bool = True

    @property
    def active_params(self) -> int:
        return self.params if self.active is None else self.active

    def row_flops(self, keys: float, follower: bool = False) -> float:
        base = self.flops if not follower or self.flops_follower is None else self.flops_follower
        return base + self.score_flops_per_key * keys

    def params_read_by_decode(self, batch: int) -> int:
        if self.decode_params is not None:
            return self.decode_params(batch)
        return self.params - self.embedding


def linear(d_in: int, d_out: int) -> Cost:
    """A bias-free linear map applied to every row."""
    n = d_in * d_out
    return Cost(params=n, flops=2 * n)
