"""The decode branch's rows: embedding ``E2``, coupling, and how the passes are arranged.

Follower ("branch") rows share every weight but their embedding, query the primary's keys and
values and write none; at three coupling sites per layer they add a learned multiple of the
primary row's activation at the same visit and position (``q``, the MLP hidden ``u`` and the MLP
output ``m``; zero-initialised vectors ``a``, ``b``, ``c``). The passes key what they record by
visit (``Context.visit``) and find a visit's coupling vectors on the block it runs
(``Transformer.visit_blocks``): under a looping schedule a layer's vectors serve each of its
visits, each coupled to the primary's activation of that visit.

Three arrangements, one per use:

* **training / evaluation** (``forward``): the primary rows run first, alone, as the baseline
  does (so their computation is bitwise the baseline's); a ``RecordPass`` pass keeps what followers
  read (coupling sources, keys/values, MoE expert choices). The follower rows then run through the
  same layers under a ``FollowPass`` pass. Rows are branch-major: row ``r*B + b`` is branch ``r`` of
  sequence ``b``.
* **prefill** (``AppendedPass``): one run over the layers. The follower rows of each prompt's
  last token are appended to the primary rows along the time axis ([B, T + n_branches]: position
  ``T + r`` of row ``b`` is branch ``r``'s embedding of prompt ``b``'s last token), so every
  per-token op runs once over both, with the baseline's kernel count (a second pass over all
  layers for one follower row per branch cost about as much as a decode step). The appended rows
  are query-only rows (``Pass.appended``): attention rotates them to position ``lengths - 1``,
  lets them see their prompt's keys/values up to it, and writes nothing to the cache for them;
  the coupling sites read the primary activation at ``lengths - 1`` of the same tensor.
* **decode** (grouped decode): primary and follower rows of the new token are stacked into one
  activation (``GroupedPass``): every weight is read once for all rows, keys/values are computed
  from the primary rows only, and every row of a sequence reads that sequence's cache in one
  attention call.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from archlab.kernels.appended_coupling import couple_appended_
from archlab.kernels.linear_cross_entropy import linear_readout_stats
from archlab.model.core.context import Context, Pass
from archlab.model.core.cost import Cost
from archlab.model.core.rows import PrimaryRows, last_of, run_layers
from archlab.model.core.spec import base_width
from archlab.model.variants.branch.readout import mean_branches, mixture_nll_of, readout_log_probs, readout_nll

if TYPE_CHECKING:
    from archlab.model.config import ModelConfig
    from archlab.model.core.decoder import Block, Transformer
    from archlab.model.core.init import Init
    from archlab.model.core.spec import LayerSpec

_COUPLING_SITES = {"q": "couple_q", "u": "couple_u", "m": "couple_m"}


class Coupling(nn.Module):
    """``t <- t + a * src`` per branch, ``a`` [n_branches, dim] (zero-initialised: uncoupled)."""

    def __init__(self, n_branches: int, dim: int):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(n_branches, dim))

    def init_parameters(self, init: "Init") -> None:
        with torch.no_grad():
            self.a.zero_()

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Follower rows ``tgt`` branch-major ([n_branches * B, T, dim]) from primary ``src``."""
        reps, b = self.a.shape[0], src.shape[0]
        t = tgt.view(reps, b, *tgt.shape[1:]) + self.a[:, None, None, :] * src[None]
        return t.reshape(tgt.shape)

    def on_time_axis(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Follower positions ``tgt`` [B, n_branches, dim], branch ``r`` at position ``r``,
        from ``src`` [B, n_branches, dim] (a prefill's appended rows, ``AppendedPass``)."""
        return tgt + self.a[None] * src


def _coupling(blocks: "list[Block]", visit: int, name: str) -> Coupling | None:
    """``blocks``: the block of each visit (``Transformer.visit_blocks``)."""
    attr = _COUPLING_SITES.get(name)
    return getattr(blocks[visit], attr, None) if attr is not None else None


class RecordPass(Pass):
    """Primary rows whose followers run afterwards: keep what the followers read."""

    def __init__(self) -> None:
        self.values: dict[tuple[int, str], Any] = {}  # by (visit, name)

    def tap(self, visit: int, name: str, x: Tensor) -> Tensor:
        self.values[(visit, name)] = x
        return x

    def share(self, visit: int, name: str, value: Any) -> Any:
        self.values[(visit, name)] = value
        return value


class FollowPass(Pass):
    """Follower rows only, after a ``RecordPass`` over their sequences' primary rows: at every
    position (training), or at one position per sequence, ``lengths - 1`` (a prefill's last token
    run as a second pass, which ``AppendedPass`` does inside the primary's; the tests keep that
    two-pass prefill as its reference), whose recorded values are picked out."""

    group = 1

    def __init__(self, blocks: "list[Block]", record: RecordPass, lengths: Tensor | None = None) -> None:
        self.blocks, self.record, self.lengths = blocks, record, lengths

    def lead(self, rows: int) -> int:
        return 0

    def _recorded(self, visit: int, name: str) -> Tensor:
        value = self.record.values[(visit, name)]
        return value if self.lengths is None else last_of(value, self.lengths)

    def tap(self, visit: int, name: str, x: Tensor) -> Tensor:
        couple = _coupling(self.blocks, visit, name)
        return x if couple is None else couple(self._recorded(visit, name), x)

    def share(self, visit: int, name: str, value: Any) -> Any:
        return self._recorded(visit, name) if value is None else value


class GroupedPass(Pass):
    """Primary rows (the first ``batch``) and their followers stacked in one activation."""

    def __init__(self, blocks: "list[Block]", batch: int) -> None:
        self.blocks, self.batch = blocks, batch

    def lead(self, rows: int) -> int:
        return self.batch

    def tap(self, visit: int, name: str, x: Tensor) -> Tensor:
        couple = _coupling(self.blocks, visit, name)
        if couple is None:
            return x
        p, f = x[: self.batch], x[self.batch:]
        return torch.cat([p, couple(p, f)])


class AppendedPass(Pass):
    """A prefill's primary rows [B, T] with each prompt's first follower rows appended on the time
    axis: position ``T + r`` of row ``b`` is branch ``r`` at position ``lengths[b] - 1`` (the
    prompt's last token). Attention makes the appended rows query-only (``Pass.appended``); the
    coupling taps add ``a_r`` times the primary's activation at that position. The follower
    semantics are ``FollowPass``'s with ``lengths``, in the same run as the primary rows."""

    def __init__(self, blocks: "list[Block]", lengths: Tensor, n_branches: int, position: Any) -> None:
        """``position``: the model's position module, for the appended rows' own tables (the
        run's ``Context.rope`` stays the baseline's, over the ordinary rows)."""
        self.blocks = blocks
        self.appended = n_branches
        self.lengths = lengths
        self.appended_positions = (lengths - 1)[:, None].expand(-1, n_branches)
        self.appended_rope = position.tables(self.appended_positions)

    def tap_appended(self, visit: int, name: str, x: Tensor, tail: Tensor) -> Tensor:
        couple = _coupling(self.blocks, visit, name)
        if couple is None:
            return tail
        # A small new tensor (the appended rows only), fused by inductor into its consumer.
        return couple.on_time_axis(self.anchor(x), tail).to(tail.dtype)

    def tap(self, visit: int, name: str, x: Tensor) -> Tensor:
        couple = _coupling(self.blocks, visit, name)
        if couple is None:
            return x
        if not torch.is_grad_enabled():
            # In place on the few appended positions, as one op that declares its mutation: a
            # concatenation, or a plain in-place write under torch.compile, copied the whole
            # activation at every tap (kernels/appended_coupling.py). The primary part keeps its
            # dtype and the baseline's values.
            couple_appended_(x, couple.a, self.lengths)
            return x
        a = self.appended  # autograd forbids writing into a split's view (``q``): a new tensor
        f = couple.on_time_axis(self.anchor(x[:, :-a]), x[:, -a:])
        return torch.cat([x[:, :-a], f.to(x.dtype)], dim=1)


class BranchRows(PrimaryRows):
    # Two readouts (the primary's and the branch's) keep two [B, T, V] logits tensors for the
    # backward; the statistics-only loss drops them (124m, H200: peak 49.7 -> 32.9 GiB, 1.03x
    # the tokens/s), so ``train.fused_readout`` left at auto uses it.
    fused_readout_by_default = True

    def __init__(self, cfg: "ModelConfig"):
        super().__init__(cfg)
        self.br = cfg.branch
        self.n_branches = cfg.branch.n_branches
        self.coupled = cfg.branch.coupling

    # ---- building -------------------------------------------------------------------------------
    def attach_embeddings(self, model: "Transformer") -> None:
        # E2: one table per branch, stacked [n_branches * V, d]
        model.branch_emb = nn.Embedding(self.n_branches * model.cfg.vocab_size, model.base_width)

    def attach_block(self, block: "Block", spec: "LayerSpec") -> None:
        if not self.coupled:
            return
        block.couple_q = Coupling(self.n_branches, spec.q_dim)
        width = type(block.mlp).coupling_width(self.cfg, spec)
        block.couple_u = Coupling(self.n_branches, width) if width else None
        block.couple_m = Coupling(self.n_branches, spec.d)

    def init_parameters(self, model: "Transformer", init: "Init") -> None:
        init.embedding(model.branch_emb.weight)

    @classmethod
    def cost(cls, cfg: "ModelConfig", specs: "list[LayerSpec]") -> Cost:
        r = cfg.branch.followers()
        embed = r * cfg.vocab_size * base_width(cfg)
        coupling = 0
        if cfg.branch.coupling:
            ffn = cfg.variant("ffn").load()
            coupling = r * sum(s.q_dim + ffn.coupling_width(cfg, s) + s.d for s in specs)
        return Cost(params=embed + coupling, follower_only=embed + coupling, embedding=embed)

    def embed(self, model: "Transformer", idx: Tensor) -> Tensor:
        """Follower rows for tokens ``idx`` [B, T]: [n_branches * B, T, d], branch-major."""
        offsets = torch.arange(self.n_branches, device=idx.device) * model.cfg.vocab_size
        return model.branch_emb((idx[None] + offsets[:, None, None]).flatten(0, 1))

    # ---- running --------------------------------------------------------------------------------
    def forward(self, model: "Transformer", idx: Tensor, ctx: Context, followers: bool = True,
                exit_after: int | None = None) -> tuple[Tensor, Tensor | None]:
        if not followers:
            return super().forward(model, idx, ctx, exit_after=exit_after)
        hidden, follower_hidden = self._hidden(model, idx, ctx, exit_after)
        primary, branch = model.logits(hidden), model.logits(follower_hidden)
        return primary, branch.view(self.n_branches, *primary.shape)

    def _hidden(self, model: "Transformer", idx: Tensor, ctx: Context, exit_after: int | None) -> tuple[Tensor, Tensor]:
        """The final hidden states of a full causal forward: the primary rows [B, T, d] and the
        follower rows [n_branches * B, T, d] (branch-major), before the head."""
        record = RecordPass()
        primary = run_layers(model, model.tok_emb(idx), dataclasses.replace(ctx, rows=record), exit_after)
        follow = dataclasses.replace(ctx, rows=FollowPass(model.visit_blocks, record))
        return primary, run_layers(model, self.embed(model, idx), follow, exit_after)

    def fused_nll(self, model: "Transformer", idx: Tensor, targets: Tensor, ctx: Context,
                  exit_after: int | None) -> Tensor | None:
        """``nll`` without the logits kept: the readouts need per-token statistics of the
        primary's and each branch's logits alone (``kernels.linear_cross_entropy``)."""
        hidden, follower_hidden = self._hidden(model, idx, ctx, exit_after)
        weight, flat = model.lm_head.weight, targets.flatten()
        lse, picked, _ = linear_readout_stats(follower_hidden.flatten(0, 1), weight, flat.repeat(self.n_branches))
        logq_y = (picked - lse).view(self.n_branches, -1)
        if self.br.readout == "branch":
            return -mean_branches(logq_y).mean()
        lse, picked, collision = linear_readout_stats(hidden.flatten(0, 1), weight, flat, squared=True)
        return mixture_nll_of(picked - lse, collision, logq_y, self.br)

    def prefill(self, model: "Transformer", idx: Tensor, ctx: Context, lengths: Tensor,
                exit_after: int | None = None) -> Tensor:
        b, t = idx.shape
        r = self.n_branches
        # The first follower rows (each prompt's last token, every branch) appended on the time
        # axis: [B, T + r]; one run over the layers (``AppendedPass``).
        follow = self.embed(model, last_of(idx, lengths)).view(r, b, -1).transpose(0, 1)
        x = torch.cat([model.tok_emb(idx), follow], dim=1)
        rows = AppendedPass(model.visit_blocks, lengths, r, model.position)
        hidden = run_layers(model, x, dataclasses.replace(ctx, rows=rows), exit_after)
        # One unembedding for what the readout needs: each prompt's last primary row, then the r
        # follower rows.
        last = torch.cat([(lengths - 1)[:, None], torch.arange(t, t + r, device=idx.device).expand(b, r)], dim=1)
        logits = model.logits(hidden[torch.arange(b, device=idx.device)[:, None], last])  # [B, 1 + r, V]
        branch = logits[:, 1:].transpose(0, 1)[:, :, None]  # [r, B, 1, V]
        return self.log_probs(logits[:, :1], branch)[:, 0]

    def decode(self, model: "Transformer", idx: Tensor, ctx: Context, exit_after: int | None = None) -> Tensor:
        b = idx.shape[0]
        x = torch.cat([model.tok_emb(idx), self.embed(model, idx)])
        grouped = dataclasses.replace(ctx, rows=GroupedPass(model.visit_blocks, b))
        logits = model.logits(run_layers(model, x, grouped, exit_after))
        primary, branch = logits[:b], logits[b:]
        return self.log_probs(primary, branch.view(self.n_branches, *primary.shape))[:, 0]

    # ---- the readout ----------------------------------------------------------------------------
    def log_probs(self, logits: Tensor, extra: Tensor | None) -> Tensor:
        return readout_log_probs(logits, extra, self.br)

    def nll(self, logits: Tensor, extra: Tensor | None, targets: Tensor) -> Tensor:
        return readout_nll(logits, extra, targets, self.br)
