"""Exact self-speculative decoding: the model's first layer visits draft, all of them verify.

One step of the running sequences (``SelfSpeculative.step``), drafting ``K`` tokens
(``--speculate K``) with the first ``k`` layer visits (``--draft-layers k``, an early exit of
``model.exit_points``):

1. **Draft.** ``K`` one-token steps through the first ``k`` visits, each read out through the
   shared final norm and head and drawn by the engine's sampler. Those visits write exactly the
   cache entries the full model writes for them. Each step keeps its residual state at visit
   ``k``; one more step runs the last draft token up to there (no readout), so every token the
   verify needs has its state at the exit.
2. **Verify.** Visits ``k .. n-1`` resume from those ``K + 1`` states in one pass over
   ``[rows, K + 1]`` positions of the cache (``Transformer.advance``). The first ``k`` visits
   are never run again; the pass writes the later visits' cache entries.
3. **Accept** (the standard speculative rule). A draft token ``x``, drawn from the draft's
   distribution ``q``, is kept with probability ``min(1, p(x) / q(x))`` under the full model's
   ``p``. At the first rejection the token is drawn from ``norm(max(0, p - q))`` instead; when
   every draft is kept, one more token comes from ``p``. ``p`` and ``q`` are what the engine's
   sampler draws from (temperature, top-k and top-p: ``sampling.sampling_probs``), so every token
   is distributed as plain sampling's. A greedy row's ``p`` and ``q`` put all their mass on their
   argmax: a draft is kept when it is the full model's argmax, and a rejection gives that argmax,
   so greedy output is plain greedy decoding's, token for token.
4. **Roll back.** Each row's position moves past the tokens it accepted, and that is all: the
   slots of rejected tokens keep stale entries, but a query at position ``t`` sees slots ``<= t``
   only, and the next step writes each slot before any query can see it.

**Lockstep, at fixed shapes.** Every slot drafts ``K`` tokens each step, and each running row
accepts its own number; a free slot's row runs too and changes nothing. A row may accept at most
its request's ``speculate`` (default ``K``) and one less than the tokens it still needs. Fixed
shapes make one step body serve every step: compiled when the engine compiles and, on CUDA,
captured as a CUDA graph per (greedy, sampled), like the plain step. A row near its end still
feeds the batch's draft tokens, positioned past its context: those land in one scratch slot past
the engine's context, never in a slot a real token uses (``Engine`` allocates the slot; where it
would pass the model's last position, the engine's context is one token shorter).

**Randomness.** Every draw is a counter-based uniform of the engine's sampler, keyed by the
request's seed and by the position it decides, in three streams: draft samples and acceptance
tests (the seed with one of two constants XORed in) and the step's last token (the seed itself,
as plain sampling). A position's token is decided by that position's numbers alone, so a
request's output depends on its seed and ``K``, ``k``, not on what shares its batch or its slot.

**Refused** with one line (``UsageError``): rows kinds that add rows per token (the draft and the
verify are one row per token), residual streams other than the standard one (the verify resumes
the draft's residual state, which is joined along positions as the standard stream's hidden
tensor; AttnRes and delta keep routed sources). A varying width is fine: its resize states are
joined too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from archlab.errors import UsageError
from archlab.infer.sampling import restrict, sample, sampling_probs, uniform_at, uniforms
from archlab.model import registry
from archlab.model.core.decoder import RunState, Transformer

if TYPE_CHECKING:
    from archlab.infer.engine import Engine, Request

#: XORed into a request's seed: the random streams of the draft samples and of the acceptance
#: tests, apart from each other and from the seed's own (the step's last token)
DRAFT_STREAM = 0x2545F4914F6CDD1D
ACCEPT_STREAM = 0x1B873593CC9E2D51


def default_draft_layers(model: Transformer) -> int | None:
    """The deepest early exit at or before half of the layer visits (the shallowest exit when
    none is that shallow); None when the model has no exit before its last visit."""
    exits = [n for n in model.exit_points if n < len(model.visits)]
    if not exits:
        return None
    half = [n for n in exits if 2 * n <= len(model.visits)]
    return max(half) if half else min(exits)


def refuse_unsupported(model: Transformer) -> None:
    """One line (``UsageError``) naming the option when ``model`` cannot be decoded
    speculatively and exactly; see the module doc."""
    cfg = model.cfg
    rows = registry.lookup(cfg, "rows")
    if rows.kind != registry.SLOTS["rows"].default:
        raise UsageError(f"--speculate: model.{rows.section_name} (rows kind {rows.kind!r}) adds rows to every "
                         f"token; self-speculative decoding drafts and verifies one row per token")
    residual = registry.kind_of(cfg, "residual")
    if residual != registry.SLOTS["residual"].default:
        raise UsageError(f"--speculate: model.residual.kind={residual} routes over earlier sublayers' outputs; "
                         f"the verify resumes the draft's residual state, which only the standard stream "
                         f"holds as one tensor per token")


@dataclass(frozen=True)
class SpeculativeOptions:
    """``--speculate K --draft-layers k``."""

    draft_tokens: int  # K: tokens drafted per step
    #: k: layer visits the draft runs (an early exit before the last visit); None: the deepest
    #: exit at or before half of the visits
    draft_layers: int | None = None

    def resolved(self, model: Transformer) -> "SpeculativeOptions":
        """These options for ``model``, with the draft depth chosen; a ``UsageError`` of one line
        naming the flag when a value is out of range or the model cannot be served."""
        refuse_unsupported(model)
        if self.draft_tokens < 1:
            raise UsageError(f"--speculate must be at least 1 (tokens drafted per step), got {self.draft_tokens}")
        n = len(model.visits)
        exits = [e for e in model.exit_points if e < n]
        if not exits:
            raise UsageError(f"--speculate needs an early exit to draft with; this model's only exit follows its "
                             f"last layer visit ({n})")
        k = default_draft_layers(model) if self.draft_layers is None else self.draft_layers
        if k not in exits:
            raise UsageError(f"--draft-layers must be an exit point before the last of the model's {n} layer "
                             f"visits: one of {', '.join(map(str, exits))}; got {k}")
        return dataclasses.replace(self, draft_layers=k)


@dataclass
class SpeculationStats:
    """What the speculative steps did so far (``SelfSpeculative.stats``)."""

    steps: int = 0  # verify passes
    row_steps: int = 0  # (running row, step) pairs
    drafted: int = 0  # draft tokens that a row could have accepted (its limit in each step)
    accepted: int = 0  # draft tokens accepted

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens / drafted."""
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def tokens_per_step(self) -> float:
        """Tokens a sequence gains per verify pass: its accepted drafts plus the one token every
        step gives (1 is plain decoding's rate)."""
        return (self.accepted + self.row_steps) / self.row_steps if self.row_steps else math.nan


def leading_true(kept: Tensor) -> Tensor:
    """How many of each row's first entries of ``kept`` [rows, n] are true, [rows]: the drafts
    accepted before the first rejection."""
    return kept.long().cumprod(1).sum(1)


def join(states: list[RunState]) -> RunState:
    """Runs over the same rows that stopped after the same visits, one position each, as one run
    over all their positions in order (the standard stream: the hidden tensors side by side)."""
    first = states[0]
    return dataclasses.replace(first, state=torch.cat([s.state for s in states], dim=1),
                               seen=[torch.cat(parts, dim=1) for parts in zip(*(s.seen for s in states))])


class SelfSpeculative:
    """The speculative decode step of an ``Engine`` (``Engine(..., speculate=options)``), which
    its scheduler runs instead of the plain step."""

    def __init__(self, engine: "Engine", options: SpeculativeOptions):
        self.engine = engine
        self.options = options.resolved(engine.model)
        self.draft_tokens = self.options.draft_tokens
        self.draft_layers: int = self.options.draft_layers  # type: ignore[assignment]  # resolved
        self.stats = SpeculationStats()
        dev = engine.device
        # Static buffers of the step (the graph's inputs and outputs): per slot, the drafts it may
        # accept this step, then its K + 1 tokens and how many of its drafts it accepted.
        self._limits = torch.full((engine.slots,), -1, dtype=torch.long, device=dev)
        self._result = torch.zeros(engine.slots, self.draft_tokens + 2, dtype=torch.long, device=dev)
        self._steps: dict[bool, Callable[[], None]] = {}  # by greedy

    def limit(self, request: "Request") -> int:
        """The most draft tokens ``request`` may accept in its next step."""
        asked = self.draft_tokens if request.params.speculate is None else request.params.speculate
        return max(0, min(asked, request.params.max_new_tokens - len(request.tokens) - 1))

    @torch.no_grad()
    def step(self, active: dict[int, "Request"]) -> dict[int, list[int]]:
        """One speculative step of the running requests (by slot): each slot's new tokens, its
        accepted drafts then one token of the full model. The slots' pending token, position and
        last predictions (``engine.tokens``, ``positions``, ``logprobs``) move past them."""
        e = self.engine
        limits = [-1] * e.slots  # a free slot: its row runs and changes nothing
        for slot, request in active.items():
            limits[slot] = self.limit(request)
        self._limits.copy_(torch.tensor(limits), non_blocking=True)
        # A batch of greedy requests takes argmaxes: the rule with all of p's and q's mass on
        # their argmax, without sampling's sorts and draws (a graph of its own).
        greedy = all(r.params.greedy for r in active.values())
        run = self._steps.get(greedy)
        if run is None:
            run = self._steps[greedy] = self._prepare(greedy)
        run()
        host = self._result.tolist()  # the step's one host sync
        s = self.stats
        s.steps += 1
        s.row_steps += len(active)
        s.drafted += sum(limits[slot] for slot in active)
        s.accepted += sum(host[slot][-1] for slot in active)
        return {slot: host[slot][:host[slot][-1] + 1] for slot in active}

    def _prepare(self, greedy: bool) -> Callable[[], None]:
        """The step body for ``greedy``, compiled when the engine compiles and, on CUDA, captured
        as a CUDA graph (``Engine.capture_step``)."""
        e = self.engine
        fn = torch.compile(self._body, dynamic=False) if e.compile else self._body
        body = lambda: fn(greedy)  # noqa: E731
        return e.capture_step(body, f"speculative step ({'greedy' if greedy else 'sampled'})") if e.cuda else body

    def _body(self, greedy: bool) -> None:
        """The step over every slot at fixed shapes (``K`` drafts, all slots: one graph serves
        every step); ``self._limits`` says how many drafts each slot may accept (-1: a free slot,
        whose token, position and predictions stay as they were). Writes each slot's ``K + 1``
        tokens and its accepted count into ``self._result``."""
        e = self.engine
        count = self.draft_tokens
        pos, seed = e.positions, e.seed
        sampling = (e.temperature, e.top_k, e.top_p)
        ahead = torch.arange(count + 1, device=pos.device)
        allowed = ahead[:count] < self._limits[:, None]  # [slots, count]
        # The position of each token fed this step, which is also its cache slot: past the
        # context, the scratch slot (module doc).
        at = torch.clamp(pos[:, None] + ahead, max=e.cache.max_len - 1)
        drafts, draft_probs, states = self._draft(at, e.tokens, sampling, seed, pos, count, greedy)
        drafted = torch.stack(drafts, 1)  # [slots, count]
        target = self._verify(at, states)  # [slots, count + 1, V]: the full model's predictions
        rows = torch.arange(e.slots, device=pos.device)
        if greedy:
            accepted = leading_true((drafted == target[:, :count].argmax(-1)) & allowed)
            token = target[rows, accepted].argmax(-1)
        else:
            accepted, token = self._accept_sampled(drafted, draft_probs, target, allowed, sampling, seed, pos)
        tokens = torch.cat([drafted, token[:, None]], 1).scatter(1, accepted[:, None], token[:, None])
        self._result.copy_(torch.cat([tokens, accepted[:, None]], 1))
        running = self._limits >= 0
        e.tokens.copy_(torch.where(running, token, e.tokens))
        e.positions.copy_(torch.where(running, pos + accepted + 1, pos))
        e.logprobs.copy_(torch.where(running[:, None], target[rows, accepted], e.logprobs))

    def _accept_sampled(self, drafted: Tensor, draft_probs: list[Tensor], target: Tensor, allowed: Tensor,
                        sampling: tuple[Tensor, Tensor, Tensor], seed: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """(accepted drafts [rows], the step's last token [rows]) by the rejection rule for the
        ``drafted`` tokens [rows, count], drawn from ``draft_probs`` ([rows, V] each), under the
        full model's predictions ``target`` [rows, count + 1, V]; ``allowed`` [rows, count]: the
        drafts each row may accept (its limit)."""
        keys = self.engine.token_keys
        count = drafted.shape[1]
        rows = torch.arange(len(pos), device=pos.device)
        accepted = torch.zeros_like(pos)
        if count:
            q = torch.stack(draft_probs, 1)  # [rows, count, V]
            p = sampling_probs(target[:, :count].flatten(0, 1),
                               *(t.repeat_interleave(count) for t in sampling)).view_as(q)
            p_x, q_x = p.gather(-1, drafted[..., None])[..., 0], q.gather(-1, drafted[..., None])[..., 0]
            u = uniform_at((seed ^ ACCEPT_STREAM).repeat_interleave(count),
                           (pos[:, None] + 1 + torch.arange(count, device=pos.device)).flatten(), drafted.flatten(),
                           keys).view_as(p_x)
            accepted = leading_true(self.keeps(u, p_x, q_x) & allowed)
        position = pos + accepted + 1  # of the step's last token
        token = sample(target[rows, accepted], *sampling, seed, position, keys)  # from p: every allowed draft kept
        if count:
            j = accepted.clamp(max=count - 1)
            residual = (p[rows, j] - q[rows, j]).clamp_min(0)
            # A rejection implies p(x) < q(x), so mass is left in max(0, p - q); a row whose p and
            # q agree to rounding keeps the token drawn from p.
            rejected = (accepted < allowed.sum(1)) & (residual.sum(-1) > 0)
            gumbel = -torch.log(-torch.log(uniforms(seed, position, keys)))
            token = torch.where(rejected, (residual.log() + gumbel).argmax(-1), token)
        return accepted, token

    @staticmethod
    def keeps(u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
        """The acceptance test of draft tokens ``x``, given ``u`` uniform in (0, 1): true with
        probability ``min(1, p(x) / q(x))`` (``q(x) > 0``: ``x`` was drawn from ``q``)."""
        return u * q_x < p_x

    def _readout(self, run: RunState) -> Tensor:
        """Log-probabilities [rows, T, V] of a run at an exit: the primary rows kind's readout,
        ``softmax`` of the head's logits (``refuse_unsupported`` leaves no other kind)."""
        model = self.engine.model
        return model.rows.log_probs(model.logits(model.read_out(run)), None)

    def _draft(self, at: Tensor, token: Tensor, sampling: tuple[Tensor, Tensor, Tensor],
               seed: Tensor, pos: Tensor, count: int,
               greedy: bool) -> tuple[list[Tensor], list[Tensor], list[RunState]]:
        """``count`` draft tokens of every slot fed ``token`` at ``at[:, 0]``: (the tokens [rows]
        each, the distributions they were drawn from [rows, V] each (none when ``greedy``: the
        argmaxes), the states at the exit of the ``count + 1`` tokens fed: ``token`` and the
        drafts)."""
        e, model = self.engine, self.engine.model
        drafts, probs, states = [], [], []
        for i in range(count + 1):
            ctx = model.cache_context(e.cache, at[:, i:i + 1])
            run = model.advance(model.begin(model.tok_emb(token[:, None]), ctx), ctx, self.draft_layers)
            states.append(run)
            if i == count:  # the last draft token: only its state at the exit, for the verify
                break
            logprobs = self._readout(run)[:, 0]
            if greedy:
                token = logprobs.argmax(-1)
            else:
                restricted = restrict(logprobs, *sampling)  # one sort for the draw and its distribution
                token = sample(logprobs, *sampling, seed ^ DRAFT_STREAM, pos + i + 1, e.token_keys, restricted)
                probs.append(sampling_probs(logprobs, *sampling, restricted))
            drafts.append(token)
        return drafts, probs, states

    def _verify(self, at: Tensor, states: list[RunState]) -> Tensor:
        """The full model's log-probabilities [rows, T, V] after each of the ``T`` tokens whose
        exit states are ``states``: the later visits resumed over all of them in one pass."""
        e, model = self.engine, self.engine.model
        ctx = model.cache_context(e.cache, at)
        return self._readout(model.advance(join(states), ctx, len(model.visits)))
