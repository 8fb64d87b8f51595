"""What one run over the layer stack sees: positions, the KV cache, and how its rows relate.

A run carries one activation tensor. Its rows are usually all *primary* rows: the baseline's
sequences, which compute keys/values and write the cache. The ``rows`` slot (the decode branch)
may add *follower* rows that share every weight but compute no keys/values of their own; it
describes them with a ``Pass``, which the few components that care consult:

* attention asks ``lead(n)``, how many leading rows compute keys/values (the rest only query);
* coupling sites call ``tap(ctx.visit, name, x)`` (``q``, ``u``, ``m``), which lets followers read
  the primary's activation at the same visit and position;
* values that followers reuse instead of computing go through ``share(ctx.visit, name, x)``
  (``kv``: the keys/values, ``experts``: MoE router replay);
* attention hands its rotated queries, keys and values to ``attend``, which a pass whose rows
  are parts of one sequence (Hidden Decoding's streams) overrides to attend across rows.

A pass may also append *query-only rows* to the end of the time axis (``appended`` of them, the
run's last positions): a run of [B, T + a] positions whose first T are the ordinary rows. An
appended row of sequence ``b`` is a query at position ``appended_positions[b, i]`` of that
sequence: attention rotates it there (``appended_rope``), lets it see the keys/values of positions
up to it, and computes and writes no keys/values for it; ``anchor`` picks the ordinary rows'
value at that position (MoE router replay reads it; ``tap_appended`` couples there). Every
other op is per token and runs on all T + a positions at once, so a few extra query rows cost no
extra pass over the layers (the decode branch's first follower rows in a prefill).

Taps, shares, the KV cache and the residual sites are keyed by *visit* (``Context.visit``: the
position in the layer schedule), not by layer: a schedule that runs a layer twice (a loop) runs it
on different hidden states, whose keys/values and activations must not overwrite each other.

The plain pass answers "every row is primary" and returns its inputs unchanged, so a component
written for the baseline works with the decode branch without knowing it exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


class Pass:
    """The plain pass: every row is primary; taps and shares return their input."""

    #: which group of rows this pass runs (0: primary rows, 1: followers), for diagnostics that
    #: tell a forward's row groups apart (routing probes)
    group = 0
    #: query-only rows appended to the time axis, their positions [B, appended] and the position
    #: tables at those positions (the run's ``Context.rope`` covers its ordinary rows only)
    appended = 0
    appended_positions: Tensor | None = None
    appended_rope: Any = None

    def lead(self, rows: int) -> int:
        """How many leading rows of an ``rows``-row activation are primary rows."""
        return rows

    def tap(self, visit: int, name: str, x: Tensor) -> Tensor:
        return x

    def share(self, visit: int, name: str, value: Any) -> Any:
        return value

    def tap_appended(self, visit: int, name: str, x: Tensor, tail: Tensor) -> Tensor:
        """``tap`` for a site whose appended rows ``tail`` [B, appended, ...] are held apart
        from the ordinary rows ``x`` [B, T, ...] (attention's queries): the new ``tail``."""
        return tail

    def anchor(self, x: Tensor) -> Tensor:
        """The ordinary rows' values ``x`` [B, T, ...] at the appended rows' positions:
        [B, appended, ...]."""
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        return x[rows, self.appended_positions]

    def attend(self, visit: int, attention: Any, q: Tensor, k: Tensor, v: Tensor, ctx: "Context", lead: int,
               q_tail: Tensor | None) -> Tensor:
        """The attention of visit ``visit``'s queries over keys/values already rotated and
        written to any cache (``attention``: the layer's ``Attention``). Every row is its own
        sequence here; a rows kind whose rows are parts of one sequence (the streams of Hidden
        Decoding, which some layers mix) attends across rows instead."""
        return attention._attend(q, k, v, ctx, lead, q_tail)


PLAIN = Pass()


@dataclass
class Context:
    """One run's positions, cache and row layout.

    * No cache: causal self-attention over the run's own sequence (training, evaluation).
    * A cache and no ``mask`` (a fresh prefill): the same causal self-attention, and the new
      keys/values are also written to the cache at ``positions``.
    * A cache and a ``mask`` [B, 1, T, S] (decode): new keys/values are written at ``positions``
      and queries attend to the cache slots the mask allows.

    ``positions`` [B, T] are each token's position in its sequence, which is also its cache slot
    (the ordinary rows'; a pass's appended rows have tables of their own, ``Pass.appended_rope``);
    ``cache_rows`` [B] the cache rows (sequences) the batch's rows use (None: rows ``0..B-1``).
    ``visit``: which entry of the layer schedule is running (``Transformer.run`` gives each visit
    its own copy of the run's context, so a recompute under activation checkpointing, which calls
    a block again after the loop has moved on, still sees its own visit).
    """

    rope: Any  # position tables from the position slot (head_dim -> (cos, sin) for RoPE)
    cache: Any = None  # a KVCache
    positions: Tensor | None = None
    cache_rows: Tensor | None = None
    mask: Tensor | None = None
    rows: Pass | None = None  # None: the plain pass
    visit: int = 0  # index into the layer schedule (``Transformer.visits``); keys cache, taps, shares
    aux: "AuxLosses" = field(default_factory=lambda: AuxLosses())  # training-only losses (MoE balance)
    #: called after the visits an exit may follow with that exit's final-normed state
    #: (``Transformer.run``'s ``on_exit``): a training run's early-exit loss; None: nothing
    on_exit: Any = None

    def __post_init__(self) -> None:
        # Not a field default: torch.compile cannot trace an object it meets only as a default
        # argument (a graph break in every compiled forward), but it can trace a global.
        if self.rows is None:
            self.rows = PLAIN

    @property
    def aux_losses(self) -> list[Tensor]:
        return self.aux.items

    def add_aux_loss(self, loss: Tensor) -> None:
        self.aux.items.append(loss)


class AuxLosses:
    """The losses a run's sublayers add, held by a plain object rather than a list field: FSDP2
    rebuilds a sublayer's dataclass and list arguments that hold tensors requiring grad (to hook
    its backward), so with a list field every sublayer after the first MoE layer would append to
    a copy and its loss would be lost. A rebuilt Context shares this object, as
    ``dataclasses.replace`` contexts do."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[Tensor] = []
