"""The inference engine: a static KV cache of fixed slots, bucketed prefill, a graph-captured decode
step, and a scheduler that streams requests through the slots (continuous batching).

    engine = Engine(model, slots=8)
    results = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=32, temperature=0))

Every model option runs through the same two model calls, ``model.prefill`` and ``model.decode``;
the model's rows kind arranges them (the decode branch runs its first row inside the prefill and
stacks its rows with the primary's in every decode step), so the engine never sees a variant.

* **Slots.** The cache holds ``slots`` sequences of up to ``max_len`` tokens; each slot has its own
  position, so a request joins the running batch by a prefill into a free slot and leaves it when
  it stops, while the others keep decoding. A decode step always runs every slot (free ones
  compute and are ignored), so its shapes never change.
* **Prefill** pads the prompts of a batch to a length bucket (powers of two from 16) and, on CUDA,
  runs a ``torch.compile``d function per (batch, bucket): a prompt length never recompiles.
* **Decode** is one step for all slots: the model's forward for the new tokens, the readout,
  sampling (``infer.sampling``: per-row parameters, no generator state) and the update of each
  slot's token and position. On CUDA it is compiled once and captured as a CUDA graph, one graph
  for greedy-only batches and one that samples; replaying it costs one launch.
* **Self-speculative decoding** (``speculate=SpeculativeOptions(K, k)``): the scheduler runs
  ``infer.speculative``'s step instead: ``K`` tokens drafted by the first ``k`` layer visits,
  verified by the rest in one pass, exact for greedy and sampled requests; every slot at fixed
  shapes, so it is compiled and captured like the plain step.
* **No host synchronisation per step** in ``generate``: tokens accumulate on the device and the
  host looks at them every ``sync_every`` steps. The scheduler that serves streams reads each
  step's tokens while the next step already runs.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from archlab.infer.logprobs import TokenLogprob, chosen_logprobs
from archlab.infer.sampling import SamplingParams, eager_inside_compiled, penalise, sample, token_keys
from archlab.infer.speculative import SelfSpeculative, SpeculativeOptions
from archlab.model.core.decoder import Transformer

MIN_BUCKET = 16


def bucket(length: int, max_len: int) -> int:
    """The prefill length a prompt of ``length`` tokens is padded to."""
    return min(max_len, max(MIN_BUCKET, 1 << math.ceil(math.log2(max(length, 1)))))


@dataclass
class Request:
    """One prompt in flight: what it asked for, what it produced, where it runs."""

    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None  # "stop" (a stop token), "length" (max_new_tokens), "cancelled"
    on_token: Callable[["Request", int], None] | None = None  # called with each new token
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    cancelled: bool = False
    #: the API's ``logprobs``: each generated token's log-probability and this many alternatives
    #: (None: none are computed)
    top_logprobs: int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked for

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(self, model: Transformer, slots: int = 8, max_len: int | None = None,
                 compile: bool | None = None, sync_every: int = 16, compile_mode: str | None = None,
                 speculate: SpeculativeOptions | None = None, compile_prefill: bool | None = None):
        self.model = model.eval()
        cfg = model.cfg
        self.max_len = min(max_len or cfg.max_seq_len, cfg.max_seq_len)
        if speculate is not None:
            # Self-speculative decoding keeps one cache slot past the context for draft tokens
            # that run past a row's end (``infer.speculative``); a position there needs its table.
            self.max_len = min(self.max_len, cfg.max_seq_len - 1)
        self.slots = slots
        self.vocab = cfg.vocab_size
        self.device = model.lm_head.weight.device
        self.sync_every = sync_every
        self.cuda = self.device.type == "cuda"
        self.compile = self.cuda if compile is None else compile
        # ``compile_prefill=False`` (``generate``: one prefill, then many steps): the prefill runs
        # eagerly and uncaptured, since compiling or capturing a shape used once costs more than
        # it saves; the decode step is still compiled (``compile``) and captured.
        self.compile_prefill = self.compile if compile_prefill is None else compile_prefill
        self.cache = model.new_cache(slots, self.max_len + (speculate is not None))
        dev = self.device
        # Per-slot state, read and updated by the decode step (static addresses for the graph).
        self.tokens = torch.zeros(slots, dtype=torch.long, device=dev)  # the token fed next
        self.positions = torch.zeros(slots, dtype=torch.long, device=dev)  # its position
        self.temperature = torch.zeros(slots, device=dev)
        self.top_k = torch.zeros(slots, dtype=torch.long, device=dev)
        self.top_p = torch.ones(slots, device=dev)
        self.seed = torch.zeros(slots, dtype=torch.long, device=dev)
        # OpenAI's penalties and logit bias (``sampling.penalise``), and each slot's counts of the
        # tokens it generated, which the prefill zeroes and every sampled token adds to on the
        # device (no host round trip per step).
        self.presence = torch.zeros(slots, device=dev)
        self.frequency = torch.zeros(slots, device=dev)
        self.bias = torch.zeros(slots, self.vocab, device=dev)
        self.counts = torch.zeros(slots, self.vocab, device=dev)
        self._one = torch.ones(slots, 1, device=dev)
        self.logprobs = torch.zeros(slots, self.vocab, device=dev)  # the last step's predictions
        self.token_keys = token_keys(self.vocab, dev)  # the sampler's per-token hash keys
        # ``step_async``'s two host buffers (pinned: the copy runs beside the next step) and their
        # events: a step's tokens land in one while the host still reads the other's.
        self._host_tokens = [torch.zeros(slots, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self._copied = [torch.cuda.Event() for _ in range(2)] if self.cuda else [None, None]
        self._flip = 0
        self._graphs: dict[tuple[bool, bool], Callable[[], None]] = {}  # by (greedy, penalised)
        self._prefills: dict[tuple[int, int], _Prefill] = {}
        self._pool = None  # the CUDA graphs' shared memory pool
        if self.compile or self.compile_prefill:
            eager_inside_compiled()
        if self.compile:
            from torch import _dynamo

            # One compiled prefill per (batch, bucket) shape and two decode variants: more than
            # dynamo's default of 8 cached graphs per function.
            _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 64)
            # ``compile_mode``: torch.compile's mode for the decode step, e.g.
            # "max-autotune-no-cudagraphs" (inductor times its Triton matmul templates against
            # cuBLAS per shape; the engine captures the graph itself).
            self._decode_fn = torch.compile(self._decode_impl, dynamic=False, mode=compile_mode)
        else:
            self._decode_fn = self._decode_impl
        # ``speculate``: the scheduler runs this step instead of the plain one
        self.speculative = SelfSpeculative(self, speculate) if speculate is not None else None

    # ---- the two phases ---------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, rows: list[int], prompts: list[list[int]], params: list[SamplingParams]) -> tuple[Tensor, Tensor]:
        """Prompts into slots ``rows``; (first new token [n], its log-probabilities [n, V]).

        The returned tensors are the prefill's own buffers: read them before the next prefill of
        the same shape (the scheduler reads the tokens at once)."""
        n = len(prompts)
        if not prompts or min(len(p) for p in prompts) < 1:
            raise ValueError("every prompt needs at least one token")
        for p, sp in zip(prompts, params):
            if len(p) + sp.max_new_tokens - 1 > self.max_len:
                raise ValueError(f"prompt ({len(p)} tokens) + max_new_tokens ({sp.max_new_tokens}) exceed the "
                                 f"context of {self.max_len} tokens")
        plan = _group_plan(n, self.group_sizes())
        if plan != [(n, n)]:
            return self._prefill_in_groups(rows, prompts, params, plan)
        return self._prefill_group(rows, prompts, params, n)

    def _prefill_group(self, rows: list[int], prompts: list[list[int]], params: list[SamplingParams],
                       real: int) -> tuple[Tensor, Tensor]:
        """One prefill call of ``len(prompts)`` rows, of which the first ``real`` are requests and
        the rest copies of the last of them (padding up to a captured group size). A copy runs
        the same prompt into the same slot, and its token is replaced by its original's before
        any state is written: the slot's token, position and counts are its original's, and the
        keys and values both write are the same prompt's (equal up to rounding)."""
        n = len(prompts)
        t = bucket(max(len(p) for p in prompts), self.max_len)
        idx = torch.zeros(n, t, dtype=torch.long)
        for i, p in enumerate(prompts):
            idx[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        source = torch.arange(n).clamp_(max=real - 1)
        inputs = (idx, torch.tensor([len(p) for p in prompts]), torch.tensor(rows), source)
        self._set_params(inputs[2][:real].to(self.device), params[:real])
        runner = self._prefills.get((n, t))
        if runner is None:
            runner = self._prefills[(n, t)] = _Prefill(self, n, t)
        return runner(*inputs)

    def _prefill_in_groups(self, rows: list[int], prompts: list[list[int]], params: list[SamplingParams],
                           plan: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        """A batch whose size is not a captured group size, in the groups of ``plan`` ((requests,
        group size) pairs, ``_group_plan``), shortest prompts first. Every prefill shape is
        compiled and captured once (about 10 s each at 124m on an H200), so a server whose
        requests arrive in groups of any size compiles at most log8(slots) + 1 shapes per length
        bucket instead of one per group size (measured: 64 streaming clients arriving at random
        were served one after another, each new group size stalling on a compilation). Sorting by
        length keeps short prompts out of long buckets, and a group's padding copies its longest
        prompt, so padding never lengthens a bucket."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        toks, logprobs, start = [], [], 0
        for real, size in plan:
            part = order[start:start + real]
            start += real
            part = part + [part[-1]] * (size - real)
            tok, lp = self._prefill_group([rows[i] for i in part], [prompts[i] for i in part],
                                          [params[i] for i in part], real)
            toks.append(tok[:real].clone())  # the group's buffers are reused by the next prefill of its shape
            logprobs.append(lp[:real].clone())
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        back = back.to(self.device)
        return torch.cat(toks)[back], torch.cat(logprobs)[back]

    def _set_params(self, rows: Tensor, params: list[SamplingParams]) -> None:
        dev = self.device
        self.temperature[rows] = torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float)
        self.top_k[rows] = torch.tensor([p.top_k for p in params], device=dev, dtype=torch.long)
        self.top_p[rows] = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float)
        self.seed[rows] = torch.tensor([p.seed for p in params], device=dev, dtype=torch.long)
        self.presence[rows] = torch.tensor([p.presence_penalty for p in params], device=dev, dtype=torch.float)
        self.frequency[rows] = torch.tensor([p.frequency_penalty for p in params], device=dev, dtype=torch.float)
        self.counts.index_fill_(0, rows, 0.0)
        self.bias.index_fill_(0, rows, 0.0)
        if any(p.logit_bias for p in params):  # a dense [n, V] table only when some request has one
            bias = torch.zeros(len(params), self.vocab)
            for i, p in enumerate(params):
                for token, value in p.logit_bias:
                    bias[i, token] = value
            self.bias[rows] = bias.to(dev)

    def _decode_impl(self, greedy: bool, penalised: bool) -> tuple[Tensor, Tensor]:
        logprobs = self.model.decode(self.tokens[:, None], self.cache, self.positions)
        # The penalties change what is drawn; the step's ``logprobs`` stay the model's own (what
        # the API reports, as vLLM's default does). Only a step with a penalised request among
        # its rows pays for them (a [slots, V] pass and the counts' update on the hot path).
        adjusted = penalise(logprobs, self.counts, self.presence, self.frequency, self.bias) if penalised else logprobs
        nxt = adjusted.argmax(-1) if greedy else sample(adjusted, self.temperature, self.top_k, self.top_p,
                                                         self.seed, self.positions + 1, self.token_keys)
        return logprobs, nxt

    def _step_body(self, greedy: bool, penalised: bool) -> None:
        logprobs, nxt = self._decode_fn(greedy, penalised)
        self.logprobs.copy_(logprobs)
        self.tokens.copy_(nxt)
        if penalised:  # a penalised request runs every one of its steps penalised: its counts stay exact
            self.counts.scatter_add_(1, nxt[:, None], self._one)
        # Free slots keep stepping; clamping keeps their (ignored) writes inside the cache.
        self.positions.copy_(torch.clamp(self.positions + 1, max=self.max_len - 1))

    @torch.no_grad()
    def step(self, greedy: bool = False, penalised: bool = False) -> Tensor:
        """One decode step of every slot: feed each slot's token, sample the next into ``tokens``
        (returned: [slots], on the device), advance the positions; ``logprobs`` holds the step's
        predictions. ``greedy``: every active slot is greedy (a cheaper graph); ``penalised``:
        some active slot has penalties or a logit bias (a graph of its own, captured on first use)."""
        if not self.cuda:
            self._step_body(greedy, penalised)
            return self.tokens
        key = (greedy, penalised)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self.capture_step(lambda: self._step_body(greedy, penalised), "decode step")
        graph()
        return self.tokens

    def step_async(self, greedy: bool = False, penalised: bool = False) -> "StepTokens":
        """``step``, with its tokens on their way to the host: ``StepTokens.wait()`` reads them.
        Launching the next step before that read lets the GPU run it while the host hands out
        this one's tokens (the server's scheduler does: ``Scheduler.step_once(pipelined=True)``).
        Two buffers alternate, so a step's tokens stay readable until two more steps have been
        launched."""
        tokens = self.step(greedy, penalised)
        k, self._flip = self._flip, self._flip ^ 1
        buf, event = self._host_tokens[k], self._copied[k]
        buf.copy_(tokens, non_blocking=self.cuda)
        if event is not None:
            event.record()
        return StepTokens(buf, event)

    def capture_step(self, body: Callable[[], None], what: str) -> Callable[[], None]:
        """``capture`` for a decode step: its warm-up runs advance the slots' tokens and positions,
        which are put back afterwards (their cache writes land at positions that prefill or
        decoding overwrite before reading them; the step's predictions are the next run's)."""
        saved = [t.clone() for t in (self.tokens, self.positions)]
        graph = self.capture(body, what)
        self.tokens.copy_(saved[0])
        self.positions.copy_(saved[1])
        return graph

    def capture(self, body: Callable[[], None], what: str) -> Callable[[], None]:
        """``body`` compiled (by its first calls) and captured as a CUDA graph, in the engine's one
        memory pool (graphs run one at a time, so they share it). A body that cannot be captured
        (one that reads a value on the host, e.g. MoE's per-expert loop outside bf16) runs
        uncaptured, said once on stderr."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    body()
            torch.cuda.current_stream().wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                body()
            return graph.replay
        except RuntimeError as e:
            import sys

            print(f"archlab: the {what} runs without a CUDA graph ({str(e).splitlines()[0][:120]})", file=sys.stderr)
            torch.cuda.synchronize()
            return body

    def warm_up(self, buckets: tuple[int, ...] = (), batch_sizes: tuple[int, ...] = (1,)) -> None:
        """Compile and capture ahead of the first request (a server does this at start): both
        decode graphs and the prefill of each bucket in ``buckets`` for each group size in
        ``batch_sizes`` (powers of eight: other sizes run as groups of those)."""
        if self.cuda and self.speculative is None:
            for greedy in (True, False):
                if (greedy, False) not in self._graphs:
                    self.step(greedy)
                    self.positions.zero_()
        for n in batch_sizes:
            for t in buckets:
                self.prefill(list(range(n)), [[0] * t] * n, [SamplingParams(max_new_tokens=1)] * n)

    def group_sizes(self) -> tuple[int, ...]:
        """The prefill group sizes that requests admitted together can need: every power of eight
        up to ``slots`` (1, 8, 64, ...). Not only the groups of a full set of slots: with 64
        slots, a batch of 63 runs as 7 x 8 + 7 x 1, so warming up (1, 64) alone left the group of
        8 to compile in the middle of serving, every waiting stream stalled behind it (a compiled
        CPU engine, 64 streams: median time to first token 5.6 s of 7.0 s before, 0.4 s after;
        a prefill shape compiles in about 10 s at 124m on an H200, where 64 streams had a median
        time to first token of 11.4 s of 13 s)."""
        sizes, size = [], 1
        while size <= self.slots:
            sizes.append(size)
            size *= 8
        return tuple(sizes)

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_token: Callable[[Request, int], None] | None = None) -> list[Request]:
        """Run every prompt to completion through the slots; the finished requests, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        requests = [Request(p, sp, on_token=on_token) for p, sp in zip(prompts, plist)]
        Scheduler(self).run(requests)
        return requests


def _step_kind(active: dict[int, Request]) -> tuple[bool, bool]:
    """Which decode graph a step of ``active`` runs: (every request greedy, some penalised)."""
    return (all(r.params.greedy for r in active.values()), any(r.params.penalised for r in active.values()))


@dataclass
class StepTokens:
    """A launched decode step's sampled tokens, copied to a host buffer behind ``event``."""

    host: Tensor
    event: "torch.cuda.Event | None"

    def wait(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


#: Whether a remainder of at least half a prefill group runs as one padded group
#: (``_group_plan``); False only to measure what that saves (``benchmarks/serve_load.py``).
PAD_PREFILL_GROUPS = True


def _group_plan(n: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """``n`` prompts admitted together as prefill calls of the captured group ``sizes`` (powers
    of eight, ``Engine.group_sizes``): (requests, group size) per call, largest first.

    A call costs about the same whatever its rows at a server's short prompts (124m on an H200:
    about 1.5 ms per graph replay, launch-bound), so fewer calls admit a burst sooner: a
    remainder of at least half a group runs as one group padded with copies (35 of 64 slots: one
    call of 64 instead of 4 x 8 + 3 x 1), a smaller one as smaller groups (20: 8 + 8 + 4 padded
    to 8). The padding at most doubles a call's rows, which bounds what it costs a long prompt,
    whose prefill is compute-bound. 13 -> [(8, 8), (5, 8)], 64 -> [(64, 64)], 3 -> three of 1."""
    plan: list[tuple[int, int]] = []
    for i in range(len(sizes) - 1, -1, -1):
        size = sizes[i]
        while n >= size:
            plan.append((size, size))
            n -= size
        if n and 2 * n >= size and PAD_PREFILL_GROUPS:
            plan.append((n, size))
            n = 0
    return plan


class _Prefill:
    """Prefill of ``n`` prompts padded to ``t`` tokens: static input buffers and, on CUDA, the
    model's prefill, the first token's sampling and the slots' state update compiled once and
    replayed as one CUDA graph (a prefill's host work would otherwise cost more than its GPU time
    at small sizes, and the decode branch's row of the last prompt token would pay it again)."""

    def __init__(self, engine: Engine, n: int, t: int):
        self.engine = e = engine
        dev = e.device
        self.idx = torch.zeros(n, t, dtype=torch.long, device=dev)
        self.lengths = torch.ones(n, dtype=torch.long, device=dev)
        self.rows = torch.zeros(n, dtype=torch.long, device=dev)
        self.source = torch.arange(n, device=dev)  # row i's token is row source[i]'s (padding copies)
        self.tok = torch.zeros(n, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros(n, e.vocab, device=dev)
        self.fn = torch.compile(self._impl, dynamic=False) if e.compile_prefill else self._impl
        self.replay: Callable[[], None] | None = None

    def _impl(self) -> tuple[Tensor, Tensor]:
        e, rows = self.engine, self.rows
        logprobs = e.model.prefill(self.idx, e.cache, self.lengths, rows)
        # The counts are zero here (``_set_params``): only the bias changes the first token.
        adjusted = penalise(logprobs, e.counts[rows], e.presence[rows], e.frequency[rows], e.bias[rows])
        tok = sample(adjusted, e.temperature[rows], e.top_k[rows], e.top_p[rows], e.seed[rows], self.lengths,
                     e.token_keys)
        return logprobs, tok

    def _body(self) -> None:
        logprobs, tok = self.fn()
        e = self.engine
        # A padding copy's token is its original's: a copy's logits can differ from its
        # original's by rounding (another row of the same matmul), and both write the one slot.
        tok = tok.index_select(0, self.source)
        self.logprobs.copy_(logprobs)
        self.tok.copy_(tok)
        e.tokens[self.rows] = tok
        e.counts[self.rows, tok] += 1  # padding copies write their original's same value
        e.positions[self.rows] = self.lengths

    def __call__(self, idx: Tensor, lengths: Tensor, rows: Tensor, source: Tensor) -> tuple[Tensor, Tensor]:
        for buf, value in ((self.idx, idx), (self.lengths, lengths), (self.rows, rows), (self.source, source)):
            buf.copy_(value, non_blocking=True)
        if not self.engine.cuda or not self.engine.compile_prefill:
            self._body()
        else:
            if self.replay is None:  # the warm-up calls prefill these very prompts
                self.replay = self.engine.capture(self._body, "prefill")
            self.replay()
        return self.tok, self.logprobs


class Scheduler:
    """Admits requests into free slots, steps the engine, hands out tokens, frees finished slots."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        #: a step launched by ``step_once(pipelined=True)`` whose tokens are not handed out yet,
        #: with the requests it ran for
        self.pending: tuple[StepTokens, dict[int, Request]] | None = None
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the batching counters: decode steps run, active rows summed over them, the most
        active rows in one step, prefill calls and the requests they admitted, the longest wait of
        a request between its submission and its prefill, and the longest single prefill call
        (seconds on the host clock: a compilation or capture shows up there)."""
        self.decode_steps = self.active_rows = self.max_active = 0
        self.prefills = self.admitted = 0
        self.max_admit_wait = self.max_prefill_s = 0.0
        self.step_s = self.emit_s = 0.0  # host time in engine.step (tokens read back) / handing them out

    @property
    def mean_step_ms(self) -> float:
        """Mean host time of one streamed decode step in the engine, tokens read back included:
        against the wall time per step, what the serving loop adds around the model."""
        return 1e3 * self.step_s / self.decode_steps if self.decode_steps else 0.0

    @property
    def mean_active(self) -> float:
        """Mean number of active (not finished) slots per decode step: how well the requests
        share the batch (1 means they ran one after another)."""
        return self.active_rows / self.decode_steps if self.decode_steps else 0.0

    def _count_step(self, active: int) -> None:
        self.decode_steps += 1
        self.active_rows += active
        self.max_active = max(self.max_active, active)

    def check(self, request: Request) -> None:
        """Raise ValueError when ``request`` cannot run (it is then never queued)."""
        request.params.check()
        if not request.prompt:
            raise ValueError("the prompt is empty")
        need = len(request.prompt) + request.params.max_new_tokens - 1
        if need > self.engine.max_len:
            raise ValueError(f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.params.max_new_tokens}) "
                             f"exceed the model's context of {self.engine.max_len} tokens")
        bias_ids = [token for token, _ in request.params.logit_bias]
        if bias_ids and max(bias_ids) >= self.engine.vocab:
            raise ValueError(f"logit_bias names token {max(bias_ids)}, outside the vocabulary of {self.engine.vocab}")
        asked, spec = request.params.speculate, self.engine.speculative
        if spec is not None and request.params.penalised:
            raise ValueError("presence_penalty, frequency_penalty and logit_bias need a server without --speculate "
                             "(the speculative step draws from the model's unchanged distribution)")
        if spec is not None and request.top_logprobs is not None:
            raise ValueError("logprobs need a server without --speculate")
        if asked and spec is None:
            raise ValueError(f"speculate={asked} needs an engine that speculates (archlab serve --speculate K)")
        if asked and asked > spec.draft_tokens:
            raise ValueError(f"speculate must be at most {spec.draft_tokens} (this engine's --speculate), got {asked}")

    def submit(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def busy(self) -> bool:
        """A request still decodes, or a launched step's tokens wait to be handed out."""
        return self.pending is not None or any(not r.done for r in self.running.values())

    def _emit(self, r: Request, token: int, logprob: TokenLogprob | None = None) -> None:
        if r.first_token_at is None:
            r.first_token_at = time.perf_counter()
        r.tokens.append(token)
        if logprob is not None:
            r.logprobs.append(logprob)
        if token in r.params.stop_tokens:
            r.finish_reason = "stop"
        elif len(r.tokens) >= r.params.max_new_tokens:
            r.finish_reason = "length"
        if r.on_token is not None:  # after the finish reason: a stream ends with its last token
            r.on_token(r, token)

    def _free(self, slot: int) -> None:
        self.running.pop(slot, None)

    def admit(self) -> None:
        """Prefill waiting requests into free slots (one prefill call for all of them)."""
        for slot, r in list(self.running.items()):
            if r.cancelled and not r.done:
                r.finish_reason = "cancelled"
            if r.done:
                self._free(slot)
        free = [s for s in range(self.engine.slots) if s not in self.running]
        batch: list[tuple[int, Request]] = []
        while self.waiting and free:
            r = self.waiting.popleft()
            if r.cancelled:
                r.finish_reason = "cancelled"
                continue
            r.slot = free.pop(0)
            batch.append((r.slot, r))
        if not batch:
            return
        t0 = time.perf_counter()
        self.prefills += 1
        self.admitted += len(batch)
        self.max_admit_wait = max(self.max_admit_wait, t0 - min(r.submitted for _, r in batch))
        tok, logprobs = self.engine.prefill([s for s, _ in batch], [r.prompt for _, r in batch],
                                            [r.params for _, r in batch])
        entries = self._logprobs(logprobs, tok, [r for _, r in batch])
        first = tok.tolist()
        self.max_prefill_s = max(self.max_prefill_s, time.perf_counter() - t0)
        for i, ((slot, r), t) in enumerate(zip(batch, first)):
            self.running[slot] = r
            self._emit(r, t, entries.get(i))

    @staticmethod
    def _logprobs(logprobs: Tensor, tokens: Tensor, requests: list[Request]) -> dict[int, TokenLogprob]:
        """{row: its token's log-probability entry} for the rows of ``logprobs`` [n, V] whose
        request asked for logprobs (one gather and one top-k for all of them; none otherwise)."""
        rows = [i for i, r in enumerate(requests) if r.top_logprobs is not None]
        if not rows:
            return {}
        index = torch.tensor(rows, device=logprobs.device)
        entries = chosen_logprobs(logprobs[index], tokens[index], [requests[i].top_logprobs for i in rows])
        return dict(zip(rows, entries))

    def run(self, requests: list[Request]) -> None:
        """Serve ``requests`` to completion. When every request fits in the slots and nothing
        streams, the host reads the tokens only every ``sync_every`` steps."""
        for r in requests:
            self.submit(r)
        while not self.idle:
            self.admit()
            active = {s: r for s, r in self.running.items() if not r.done}
            if not active:
                continue
            if self.waiting or self.engine.speculative is not None or any(
                    r.on_token is not None or r.top_logprobs is not None for r in active.values()):
                self.step_once()
            else:
                self._run_unsynced(active)

    def step_once(self, pipelined: bool = False) -> None:
        """One decode step for every slot; each running request gets its token (a speculative
        step: its accepted draft tokens and one more).

        ``pipelined`` (the server): launch this step, then hand out the previous step's tokens
        while the GPU runs it, so the host's work per step (callbacks, detokenising, the event
        loop) overlaps the model's instead of adding to it. A request that the previous step
        finishes has run one step too many: its token is dropped. Steps that need their rows on
        the host at once (logprobs) or a variable number of tokens (speculation) run unpipelined,
        after the pending step's tokens are out."""
        active = {s: r for s, r in self.running.items() if not r.done}
        if pipelined and self.engine.speculative is None and not any(
                r.top_logprobs is not None for r in active.values()):
            launched = None
            if active:
                greedy, penalised = _step_kind(active)
                launched = (self.engine.step_async(greedy, penalised), active)
            previous, self.pending = self.pending, launched
            if previous is not None:
                self._hand_out(*previous)
            return
        self.flush()
        active = {s: r for s, r in self.running.items() if not r.done}
        if not active:
            return
        greedy, penalised = _step_kind(active)
        self._count_step(len(active))
        t0 = time.perf_counter()
        logprobs: dict[int, TokenLogprob] = {}  # by slot; the speculative step refuses logprobs
        if self.engine.speculative is not None:
            produced = self.engine.speculative.step(active)
        else:
            step_tokens = self.engine.step(greedy, penalised)
            tokens = step_tokens.tolist()
            produced = {slot: [tokens[slot]] for slot in active}
            if any(r.top_logprobs is not None for r in active.values()):  # no copy of the step's rows otherwise
                slots = list(active)
                entries = self._logprobs(self.engine.logprobs[slots], step_tokens[slots], list(active.values()))
                logprobs = {slots[i]: entry for i, entry in entries.items()}
        t1 = time.perf_counter()
        for slot, r in active.items():
            for token in produced[slot]:
                if not r.done:  # a stop token among accepted drafts ends the request there
                    self._emit(r, token, logprobs.get(slot))
        self.step_s += t1 - t0
        self.emit_s += time.perf_counter() - t1

    def flush(self) -> None:
        """Hand out the pending step's tokens, if a pipelined step left some."""
        if self.pending is not None:
            previous, self.pending = self.pending, None
            self._hand_out(*previous)

    def _hand_out(self, step: StepTokens, ran: dict[int, Request]) -> None:
        """A pipelined step's tokens to the requests it ran for that have not finished since
        (finished or cancelled ones ran a step too many; a slot freed and refilled meanwhile
        belongs to its new request, which this step did not run for)."""
        t0 = time.perf_counter()
        tokens = step.wait()
        t1 = time.perf_counter()
        live = [(slot, r) for slot, r in ran.items() if not r.done]
        if live:
            self._count_step(len(live))
        for slot, r in live:
            self._emit(r, tokens[slot])
        self.step_s += t1 - t0
        self.emit_s += time.perf_counter() - t1

    def _run_unsynced(self, active: dict[int, Request]) -> None:
        """Steps whose tokens stay on the device until ``sync_every`` of them have run."""
        eng = self.engine
        greedy, penalised = _step_kind(active)
        left = max(r.params.max_new_tokens - len(r.tokens) for r in active.values())
        n = min(eng.sync_every, left)
        out = torch.empty(n, eng.slots, dtype=torch.long, device=eng.device)
        for i in range(n):
            self._count_step(sum(1 for r in active.values() if len(r.tokens) + i < r.params.max_new_tokens))
            out[i] = eng.step(greedy, penalised)
        for row in out.tolist():
            for slot, r in active.items():
                if not r.done:
                    self._emit(r, row[slot])
