"""The one model: a pre-norm Llama-style decoder whose variants fill slots, not copies of it.

    x = E1[idx]
    for each visit:  x = x + Attn(Norm(x));  x = x + FFN(Norm(x))      (the residual stream)
    logits = W_out Norm(x)

A *visit* is one entry of the layer schedule (the ``schedule`` slot): usually every layer once, in
order, but a schedule may run a layer again (a loop) or leave one out. What differs between two
runs of the same weights is keyed by visit: the KV cache entry, the residual sites ``2v`` and
``2v + 1``, the rows' taps and the per-run costs; parameters belong to the layer. A run may stop
after its first visits and read out there (early exit, ``exit_after``), or stop and go on later
(``begin``, ``advance``, ``read_out``: self-speculative decoding); a schedule kind may let
rows skip a visit in training (layer dropout) or transform the state between visits (a loop's
channel) through its optional hooks (``core.spec.Sequential``).

Every piece is the kind a config chooses for its slot (``archlab.model.registry``): the layer
shapes (``heads``, ``width``), the positions, the norms, the init, the FFN, the residual stream,
the layer schedule, and the rows (the decode branch adds follower rows and its readout). This
file names no variant.

Cached inference runs through ``prefill``/``decode``, which the rows kind arranges (the decode
branch runs its first follower row inside the prefill and stacks primary and follower rows in
every decode step); both return the readout's log-probabilities of the next token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from archlab.model import registry
from archlab.model.config import ModelConfig
from archlab.model.core.context import Context
from archlab.model.core.layers import Attention, KVCache, Linear
from archlab.model.core.spec import LayerSpec, base_width, layer_specs, layer_visits, visit_specs


@dataclass
class ModelOutput:
    logits: Tensor | None  # primary logits [B, T, V]; None when the loss was asked without them
    #: logits of the rows kind's follower rows (the decode branch: [n_branches, B, T, V]), or None
    extra_logits: Tensor | None = None
    loss: Tensor | None = None  # training objective (NLL + auxiliary losses)
    nll: Tensor | None = None  # the readout's negative log-likelihood alone
    aux_loss: Tensor | None = None
    #: ``nll`` is an upper bound on the negative log-likelihood (an ELBO), not its exact value
    nll_is_bound: bool = False


@dataclass
class RunState:
    """A run over the layers after its first ``done`` visits (``Transformer.begin``, ``advance``):
    the residual stream's state, its width there and the states at each resize so far, which the
    width slot's refill reads; ``rows`` and ``device`` are what the schedule's ``keep`` asks."""

    state: Any  # the residual kind's state (the standard stream's: the hidden tensor [R, T, d])
    done: int
    width: int
    seen: list[Tensor]
    rows: int
    device: torch.device


class Block(nn.Module):
    """One layer: attention and FFN sublayers with their norm sites. A rows kind may add its own
    per-layer parameters (``attach_block``): they come after the block's own."""

    #: the methods the decoder calls instead of ``forward`` (one per sublayer): wrappers that act
    #: around a module's forward (FSDP's gather of sharded weights, activation checkpointing,
    #: per-block compilation; archlab.train.distributed) wrap these
    ENTRY_POINTS = ("attention", "feed_forward")
    #: the sublayer modules that hold nearly all of a block's weights, each called once per
    #: entry point: FSDP shards each as one unit (gathered once per call); the block's small
    #: parameters (norm gains, coupling vectors) stay with the model's root unit
    SHARD_UNITS = ("attn", "mlp")

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, norms: nn.Module, ffn: type):
        super().__init__()
        self.layer = spec.layer
        self.attn_norm = norms.site(spec, "attn_in", spec.d)
        self.attn = Attention(spec)
        self.attn_out_norm = norms.site(spec, "attn_out", spec.d)
        self.mlp_norm = norms.site(spec, "mlp_in", spec.d)
        self.mlp = ffn(cfg, spec)
        self.mlp_out_norm = norms.site(spec, "mlp_out", spec.d)

    def init_parameters(self, init) -> None:
        for child in self.children():
            child.init_parameters(init)

    def attention(self, h: Tensor, ctx: Context) -> Tensor:
        out = self.attn(self.attn_norm(h), ctx)
        return out if self.attn_out_norm is None else self.attn_out_norm(out)

    def feed_forward(self, h: Tensor, ctx: Context) -> Tensor:
        out = self.mlp(self.mlp_norm(h), ctx)
        if self.mlp_out_norm is not None:
            out = self.mlp_out_norm(out)
        return ctx.rows.tap(ctx.visit, "m", out)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        kinds = registry.chosen(cfg)
        self.specs = layer_specs(cfg)
        self.visits = layer_visits(cfg)
        # The schedule kind's optional hooks (``core.spec.Sequential`` lists them): ``keep`` lets
        # rows drop a visit in training (layer dropout), ``between`` transforms the state before
        # some visits (a loop's channel), ``set_training_progress`` hears how far training is.
        self.schedule = kinds["schedule"].load()(cfg)
        self.visit_keep = getattr(self.schedule, "keep", None)
        self.visit_specs = visit_specs(cfg, self.specs)
        self.base_width = base_width(cfg)
        self.widths = [s.d for s in self.specs]
        self.varying_width = len(set(self.widths + [self.base_width])) > 1
        # Construction order is part of reproducibility: modules draw their default init from the
        # global RNG as they are built, and the parameter order fixes the optimizer's and the
        # gradient-norm reduction's order. Embeddings, rows, residual, layers, final norm, head.
        self.tok_emb = nn.Embedding(cfg.vocab_size, self.base_width)
        self.rows = kinds["rows"].load()(cfg)
        self.rows.attach_embeddings(self)
        self.position = kinds["position"].load()(cfg, self.specs)
        self.norms = kinds["norm"].load()(cfg)
        self.init_scheme = kinds["init"].load()(cfg)
        # The residual stream has two sites per visit, so it is built over the visits' specs.
        self.residual = kinds["residual"].load()(cfg, self.visit_specs)
        ffn = kinds["ffn"].load()
        self.layers = nn.ModuleList()
        for spec in self.specs:
            block = Block(cfg, spec, self.norms, ffn)
            self.rows.attach_block(block, spec)
            self.layers.append(block)
        self.final_width = final = self.widths[self.visits[-1]]
        self.norm = self.norms.site(None, "final", final)
        self.lm_head = Linear(final, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # Last: a schedule without it builds nothing, and every module above draws as before.
        make_between = getattr(self.schedule, "between", None)
        self.between = make_between() if make_between is not None else None
        # Early exit may stop after visit v when the state there has the final norm's width.
        self.exit_points = [n for n in range(1, len(self.visits) + 1) if self.widths[self.visits[n - 1]] == final]
        self.reset_parameters()

    # ---- initialisation ----------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Every component initialises its own parameters through the init kind, in build order."""
        init = self.init_scheme
        init.embedding(self.tok_emb.weight)
        self.rows.init_parameters(self, init)
        if hasattr(self.norms, "init_parameters"):
            self.norms.init_parameters(init)
        self.residual.init_parameters(init)
        for block in self.layers:
            block.init_parameters(init)
        self.norm.init_parameters(init)
        init.linear(self.lm_head.weight, role="head")  # tied: the table's final value is this draw
        if self.between is not None:
            self.between.init_parameters(init)

    # ---- one run over the layers -------------------------------------------------------------
    def run(self, x: Tensor, ctx: Context, exit_after: int | None = None,
            on_exit: Callable[[int, Tensor], None] | None = None) -> Tensor:
        """Embedded rows [R, T, d] through the layer schedule; the final-normed hidden state.

        ``exit_after``: run only the first that many visits and read out there through the final
        norm (early exit; those visits write exactly the cache entries the full run writes).
        ``on_exit(visit, hidden)``: called after every visit an exit may follow, with the
        final-normed state that exit reads out (every exit's loss in one run)."""
        if exit_after is not None and exit_after not in self.exit_points:
            raise ValueError(f"exit_after={exit_after}: an exit may follow visits {self.exit_points}")
        until = len(self.visits) if exit_after is None else exit_after
        on_exit = on_exit if on_exit is not None else ctx.on_exit
        return self.read_out(self.advance(self.begin(x, ctx), ctx, until, on_exit))

    def begin(self, x: Tensor, ctx: Context) -> RunState:
        """A run over the layers of embedded rows ``x`` that has run no visit yet."""
        return RunState(state=self.residual.start(x, ctx), done=0, width=self.base_width, seen=[], rows=x.shape[0],
                        device=x.device)

    def advance(self, run: RunState, ctx: Context, until: int,
                on_exit: Callable[[int, Tensor], None] | None = None) -> RunState:
        """``run`` continued through visits ``run.done .. until - 1`` under ``ctx`` (``run`` itself
        is left as it was). ``Transformer.run`` is ``begin``, one ``advance`` and ``read_out``; cut
        there, a run can stop after an exit and go on later, even over more positions at once: the
        self-speculative engine resumes its drafts' states to verify them in one pass
        (``archlab.infer.speculative``)."""
        if not run.done <= until <= len(self.visits):
            raise ValueError(f"cannot advance a run after {run.done} visits to {until} of {len(self.visits)}")
        state, width = run.state, run.width
        seen = list(run.seen)  # states at each resize (the width slot's refill)
        for visit in range(run.done, until):
            layer = self.visits[visit]
            block = self.layers[layer]
            if self.between is not None and visit in self.between.before:
                state = self.between(state, visit, self)
            if self.varying_width and self.widths[layer] != width:
                width = self.widths[layer]
                state = self.residual.resize(state, width, seen)
            # Each visit its own context (not one mutated in place): activation checkpointing calls
            # a block again in backward, after the loop has moved on, and must see this visit.
            vctx = dataclasses.replace(ctx, visit=visit)
            site = 2 * visit
            kept = self.visit_keep(visit, run.rows, run.device) if self.training and self.visit_keep else None
            if kept is None:
                out = block.attention(self.residual.read(state, site), vctx)
                state = self.residual.write(state, site, out)
                out = block.feed_forward(self.residual.read(state, site + 1), vctx)
                state = self.residual.write(state, site + 1, out)
            else:
                state = self._run_kept_rows(block, state, kept, vctx)
            # ``on_exit.visits``: the only visits a hook reads (the early-exit loss's exits)
            if on_exit is not None and width == self.final_width and visit in getattr(on_exit, "visits", (visit,)):
                on_exit(visit, self.norm(self.residual.final(state)))
        return dataclasses.replace(run, state=state, done=until, width=width, seen=seen)

    def read_out(self, run: RunState) -> Tensor:
        """The final-normed hidden state of ``run``, which must stand at an exit point."""
        if run.done not in self.exit_points:
            raise ValueError(f"a run after {run.done} visits cannot read out: an exit may follow visits "
                             f"{self.exit_points}")
        return self.norm(self.residual.final(run.state))

    @staticmethod
    def _run_kept_rows(block: Block, h: Tensor, kept: tuple[Tensor, Tensor | float], ctx: Context) -> Tensor:
        """A visit that some rows drop in training (the schedule's ``keep``: the kept rows'
        indices and the scale of their update): only the kept rows run the block, and their update
        ``Attn + FFN`` is scaled and added back; a dropped row passes through and costs nothing.
        Scaling the block's whole update keeps the expected output of a block the unscaled one's.
        The state is the hidden tensor itself: a kind that drops rows refuses other residual kinds."""
        rows, scale = kept
        if rows.numel() == 0:  # a shape: known on the host, no device sync
            return h
        every = rows.numel() == h.shape[0]
        x = h if every else h.index_select(0, rows)
        a = block.attention(x, ctx)
        update = (a.to(h.dtype) + block.feed_forward(x + a, ctx).to(h.dtype)) * scale
        return h + update if every else h.index_add(0, rows, update.to(h.dtype))

    def set_training_progress(self, progress: float) -> None:
        """How far training is (0 at the first step, 1 at the end), for a schedule kind that
        changes over the run (layer dropout's probabilities decay); nothing for the others."""
        hook = getattr(self.schedule, "set_training_progress", None)
        if hook is not None:
            hook(progress)

    @property
    def visit_blocks(self) -> list[Block]:
        """The block each visit runs, in schedule order (what the rows' passes index by visit)."""
        return [self.layers[layer] for layer in self.visits]

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    # ---- training / evaluation ----------------------------------------------------------------
    def forward(self, idx: Tensor, targets: Tensor | None = None, followers: bool = True,
                exit_after: int | None = None, return_logits: bool = True) -> ModelOutput:
        """Full causal forward over [B, T] tokens; with targets, the readout's loss.
        ``followers=False`` runs the primary rows alone (the baseline's function);
        ``exit_after``: read out after that many visits (early exit, ``run``);
        ``return_logits=False`` (training): the caller needs the loss alone, so a rows kind that
        can (``rows.fused_nll``: the plain readout and the decode branch's) computes it without
        keeping the [B, T, V] logits; the output's ``logits`` is then None."""
        ctx = Context(rope=self.position.tables(idx.shape[1]))
        # A schedule kind that trains early exits too (layer dropout's exit loss) reads each
        # exit of the training run, adding its loss to the run's training-only losses.
        exit_hook = getattr(self.schedule, "exit_loss_hook", None)
        if exit_hook is not None and self.training and targets is not None and exit_after is None:
            ctx.on_exit = exit_hook(self, targets, ctx.aux)
        # A rows kind that is a training objective of its own (``model.objective``: uniform
        # diffusion) scores the clean targets itself rather than predicting them from ``idx``.
        own = getattr(self.rows, "objective_nll", None) if targets is not None else None
        fuse = getattr(self.rows, "fused_nll", None)
        fused = None
        if fuse is not None and not return_logits and targets is not None and own is None and followers:
            fused = fuse(self, idx, targets, ctx, exit_after)
        if fused is not None:
            out = ModelOutput(logits=None)
        elif own is not None:
            logits, nll = own(self, targets, ctx, exit_after)
            out = ModelOutput(logits=logits, nll_is_bound=True)
        else:
            logits, extra = self.rows(self, idx, ctx, followers=followers, exit_after=exit_after)
            out = ModelOutput(logits=logits, extra_logits=extra)
        out.aux_loss = torch.stack(ctx.aux_losses).sum() if ctx.aux_losses else None
        if targets is not None:
            out.nll = fused if fused is not None else nll if own is not None else self.rows.nll(logits, extra, targets)
            out.loss = out.nll if out.aux_loss is None else out.nll + out.aux_loss
        return out

    def log_probs(self, out: ModelOutput) -> Tensor:
        """The model's prediction (the rows kind's readout) as log-probabilities [B, T, V]."""
        return self.rows.log_probs(out.logits, out.extra_logits)

    # ---- cached inference ---------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> KVCache:
        # One entry per visit: a layer run twice computes its keys/values from two hidden states.
        shapes = [(s.n_kv_heads, s.head_dim) for s in self.visit_specs]
        ref = self.lm_head.weight
        # A rows kind that caches several rows per token (Hidden Decoding's streams) asks for
        # that many cache rows per sequence.
        return KVCache(shapes, self.rows.cache_batch(batch), max_len, device or ref.device, dtype or ref.dtype)

    def cache_context(self, cache: KVCache, positions: Tensor, cache_rows: Tensor | None = None) -> Context:
        """A run of tokens at ``positions`` [B, T] that attends to the cache: each query sees its
        sequence's slots up to its own position."""
        slots = torch.arange(cache.max_len, device=positions.device)
        mask = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
        return Context(rope=self.position.tables(positions), cache=cache, positions=positions,
                       cache_rows=cache_rows, mask=mask[:, None])

    def prefill(self, idx: Tensor, cache: KVCache, lengths: Tensor, cache_rows: Tensor | None = None,
                exit_after: int | None = None) -> Tensor:
        """Run prompts ``idx`` [B, T] (row ``b``'s first ``lengths[b]`` tokens; the rest is
        padding) into cache ``rows`` from position 0; log-probabilities of each prompt's next
        token [B, V]. Padding writes cache slots that decoding overwrites before it reads them.
        ``exit_after``: only the first that many visits run (and write their cache entries)."""
        b, t = idx.shape
        positions = torch.arange(t, device=idx.device).expand(b, t)
        ctx = Context(rope=self.position.tables(t), cache=cache, positions=positions, cache_rows=cache_rows)
        return self.rows.prefill(self, idx, ctx, lengths, exit_after=exit_after)

    def decode(self, idx: Tensor, cache: KVCache, positions: Tensor, cache_rows: Tensor | None = None,
               exit_after: int | None = None) -> Tensor:
        """One new token per sequence, ``idx`` [B, 1] at ``positions`` [B]; log-probabilities of
        the next token [B, V]. ``exit_after``: as in ``prefill``."""
        ctx = self.cache_context(cache, positions[:, None], cache_rows)
        return self.rows.decode(self, idx, ctx, exit_after=exit_after)
