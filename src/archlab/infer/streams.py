"""From the engine thread to HTTP responses: each choice of a response (``Choice``) is one engine
request whose tokens reach its handler's asyncio queue (through a ``Mailbox``: one wake-up of the
event loop per batch of tokens) and become text (``TextStream``: incremental detokenisation that
never takes back what it sent), with the tokens' log-probabilities when asked for. ``Serving``
holds what every handler shares and submits a request's choices; ``merged`` interleaves the
choices of one streaming response."""

import asyncio
import threading
import time
from typing import Any, AsyncIterator

from archlab.infer.engine import Request
from archlab.infer.engine_loop import EngineFailed, EngineLoop, QueueFull
from archlab.infer.logprobs import TokenLogprob, prompt_logprobs
from archlab.infer.metrics import ServerMetrics
from archlab.infer.openai_api import BadRequest, Generation
from archlab.infer.server_limits import RETRY_AFTER_S, ServerLimits


_WINDOW = 6  # tokens of already-decoded context each incremental decode starts from at least


class TextStream:
    """Incremental detokenisation: the new text after each token, cut at the first stop string
    (which is not returned); ``hidden``: token ids left out of the text (end-of-text, a chat
    template's end-of-turn). Until the last token it holds back an incomplete UTF-8 character and
    any tail that could still grow into a stop string, so no text sent is ever taken back.

    Each token decodes a short window, not the whole sequence: decoding every stream's full text
    at every step cost O(length) per token, in the one process that serves every stream. The
    window starts a few decoded tokens back, because a decoder may render a token differently at
    the start of a text (a leading space dropped, a byte sequence cut); the new text is what the
    window adds to the decode of its first part (as Hugging Face's and vLLM's incremental
    detokenisers do), and the whole text is decoded once where that does not hold. The window's
    start stays put while it grows from ``_WINDOW`` to ``2 * _WINDOW`` decoded tokens, so the
    decode of its first part is the previous token's window, kept: one decode per token, not two
    (detokenising was 40% of the event loop's time serving 64 streams, py-spy on the CPU VM)."""

    def __init__(self, tokenizer, stops: tuple[str, ...], hidden: int | tuple[int, ...] | None):
        self.tokenizer, self.stops = tokenizer, stops
        self.hidden = (hidden,) if isinstance(hidden, int) else tuple(hidden or ())
        self.ids: list[int] = []
        self.read = 0  # ids[:read] are decoded; ids[read:] not yet
        self.decoded_chars = 0  # the length of the text of ids[:read]
        self.start = 0  # the window's first token
        self.before = ""  # the decode of ids[start:read]
        self.held = ""  # decoded text not sent yet: a tail that may grow into a stop string
        self.stopped = False

    def _anchor(self) -> None:
        """Move the window's start to ``_WINDOW`` tokens before ``read`` (further back past tokens
        that decode to nothing, such as special ones, which give no anchor)."""
        start = max(0, self.read - _WINDOW)
        before = self.tokenizer.decode(self.ids[start:self.read])
        while not before and start > 0:
            start = max(0, start - _WINDOW)
            before = self.tokenizer.decode(self.ids[start:self.read])
        self.start, self.before = start, before

    def _advance(self, final: bool) -> str:
        """The complete text of the tokens since the last call ("" while a character is unfinished)."""
        if self.read - self.start > 2 * _WINDOW or (not self.before and self.start > 0):
            self._anchor()
        window = self.tokenizer.decode(self.ids[self.start:])
        if window.endswith("\ufffd") and not final:
            return self._past_invalid_bytes(window)
        self.read = len(self.ids)
        return self._added(window)

    def _past_invalid_bytes(self, window: str) -> str:
        """The text a window that ends in U+FFFD adds before its last 3 tokens, when that much is
        final: "" otherwise. An unfinished character is at most its first 3 bytes, so when at least
        3 bytes follow token ``k`` (the tail's decode has 3 or more characters, each one byte or
        more), a character begun before ``k`` is complete in the window, and the text up to ``k``
        is final if the window begins with it. Without this, a run of invalid bytes (a lone
        continuation byte repeated) held back the whole stream and decoded a window growing with
        it: quadratic, and nothing streamed until the end."""
        k = len(self.ids) - 3
        if k <= self.read or len(self.tokenizer.decode(self.ids[k:])) < 3:
            return ""
        head = self.tokenizer.decode(self.ids[self.start:k])
        if not window.startswith(head):
            return ""
        self.read = k
        return self._added(head)

    def _added(self, window: str) -> str:
        """What ``window``, the decode of ``ids[start:read]`` just advanced, adds to the text."""
        before, self.before = self.before, window
        if window.startswith(before):
            return window[len(before):]
        # A decoder whose text for the window's first tokens changed with what followed: the
        # whole text up to ``read`` once, which is always right.
        return self.tokenizer.decode(self.ids[:self.read])[self.decoded_chars:]

    def add(self, token: int, final: bool = False) -> str:
        if token not in self.hidden:
            self.ids.append(token)
        return self._new_text(final)

    def close(self) -> str:
        """The text still held back when a stream ends without a last token (its time limit):
        an unfinished character (as U+FFFD), a tail that did not become a stop string."""
        return "" if self.stopped else self._new_text(final=True)

    def _new_text(self, final: bool) -> str:
        """The text to send now. Only the unsent tail is searched for stop strings: a stop string
        cannot begin in text already sent, since any tail that could begin one is held back. The
        whole text is never rebuilt, so a token costs the same at the end of a long stream as at
        its start."""
        new = self._advance(final)
        self.decoded_chars += len(new)
        if not self.stops:
            return new
        text = self.held + new
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped, self.held = True, ""
            return text[: min(cuts)]
        hold = 0 if final else max(
            (k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
            default=0)
        self.held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]


class Mailbox:
    """Tokens from the engine thread to the handlers' queues on the event loop: one wake-up of
    the loop per batch of tokens (a decode step hands out one token to every running stream),
    not one per token, so the loop's overhead does not grow with the number of streams."""

    def __init__(self, aloop: asyncio.AbstractEventLoop):
        self.aloop = aloop
        self.lock = threading.Lock()
        self.items: list[tuple[asyncio.Queue, Any]] = []

    def post(self, queue: asyncio.Queue, item: Any) -> None:  # the engine thread
        with self.lock:
            first = not self.items
            self.items.append((queue, item))
        if first:  # a flush already scheduled takes this item too
            self.aloop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:  # the event loop
        with self.lock:
            items, self.items = self.items, []
        for queue, item in items:
            queue.put_nowait(item)


TIME_UP = -2  # put on a request's token queue when its time limit passes (-1: the engine failed)


class Choice:
    """One choice of a response: an engine request, and the text, log-probabilities and finish
    reason it streams back to its handler. Metrics, the request's time limit and its end (a
    request still in the engine when its handler stops is cancelled: its slot frees) are kept
    here, once per choice."""

    def __init__(self, serving: "Serving", ids: list[int], params, top_logprobs: int | None, arrived: float,
                 stops: tuple[str, ...], hidden: tuple[int, ...]):
        self.serving, self.ids, self.arrived = serving, ids, arrived
        self.stops, self.hidden = stops, hidden
        self.tokens: asyncio.Queue = asyncio.Queue()
        self.mailbox = serving.mailbox()
        self.last_token_at: float | None = None
        self.delivered = 0  # tokens whose text reached the response (the usage counts these)
        self.ending: list[str] = []  # the outcome, once decided
        self.timer: asyncio.TimerHandle | None = None
        self.request = Request(ids, params, on_token=self._on_token, top_logprobs=top_logprobs)

    def _on_token(self, r: Request, token: int) -> None:  # the engine thread
        metrics = self.serving.metrics
        if token >= 0:
            now = time.perf_counter()
            metrics.generated_tokens.inc()
            if self.last_token_at is None:
                metrics.ttft.observe(now - self.arrived)
            else:
                metrics.token_latency.observe(now - self.last_token_at)
            self.last_token_at = now
        entry = r.logprobs[-1] if token >= 0 and r.top_logprobs is not None else None
        self.mailbox.post(self.tokens, (token, r.finish_reason, entry))

    def submit(self) -> None:
        """Queue the request for the engine, or ``BadRequest`` (429 past ``--max-queue``)."""
        s = self.serving
        try:
            s.loop.submit(self.request, max_waiting=s.limits.max_queue)
        except QueueFull as e:
            raise BadRequest(str(e), None, 429, "queue_full", "server_busy",
                             {"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineFailed:
            s.metrics.requests.inc(value="error")
            raise
        except ValueError as e:
            text = str(e)
            param = next((p for p in ("speculate", "logit_bias", "logprobs", "prompt") if p in text), None)
            if param is None:
                param = "presence_penalty" if "penalty" in text else "max_tokens"
            raise BadRequest(text, param) from None
        s.metrics.started()
        s.metrics.prompt_tokens.inc(len(self.ids))
        if s.limits.request_timeout is not None:
            left = s.limits.request_timeout - (time.perf_counter() - self.arrived)
            self.timer = asyncio.get_running_loop().call_later(max(0.0, left), self.tokens.put_nowait,
                                                               (TIME_UP, None, None))

    def end(self, outcome: str) -> None:
        if self.ending:
            return
        self.ending.append(outcome)
        if self.timer is not None:
            self.timer.cancel()
        if not self.request.done:
            self.request.cancelled = True
        self.serving.metrics.ended(outcome, time.perf_counter() - self.arrived)

    async def pieces(self) -> AsyncIterator[tuple[str, str | None, list[TokenLogprob]]]:
        """(new text, finish reason or None, the log-probabilities of the tokens since the last
        piece) per batch of the tokens that have arrived, until the request ends: a stream that
        falls behind catches up in fewer, larger chunks. After the first piece with text (sent
        at once: the time to first token), a piece waits until ``stream_interval`` tokens have
        arrived since the last one; the last piece goes when the request ends."""
        text = TextStream(self.serving.tokenizer, self.stops, self.hidden)
        interval = self.serving.stream_interval
        entries: list[TokenLogprob] = []
        parts: list[str] = []
        waiting = 0  # tokens whose text is in ``parts`` and not yet sent
        sent = False
        while True:
            arrived_now = [await self.tokens.get()]
            while not self.tokens.empty():
                arrived_now.append(self.tokens.get_nowait())
            for token, finish, entry in arrived_now:
                if token == TIME_UP:  # the text so far ends it, as max_tokens would have
                    self.end("timeout")
                    yield "".join(parts) + text.close(), "length", entries
                    return
                if token < 0:
                    self.end("error")
                    raise EngineFailed(f"the engine failed: {self.serving.loop.error!r}")
                self.delivered += 1
                if entry is not None:
                    entries.append(entry)
                parts.append(text.add(token, final=finish is not None))
                waiting += 1
                if text.stopped:  # the stop string ends it; ``end`` frees the slot
                    self.end("stop")
                    yield "".join(parts), "stop", entries
                    return
                if finish is not None:
                    self.end("stop" if finish == "stop" else "length")
                    yield "".join(parts), "stop" if finish == "stop" else "length", entries
                    return
            if any(parts) and (not sent or waiting >= interval):
                yield "".join(parts), None, entries
                parts, entries, waiting, sent = [], [], 0, True

    async def collect(self) -> tuple[str, str | None, list[TokenLogprob]]:
        parts, finish, entries = [], None, []
        async for delta, finish, new in self.pieces():
            parts.append(delta)
            entries.extend(new)
        return "".join(parts), finish, entries


class Serving:
    """What every handler shares: the engine loop, the tokenizer, metrics, limits, and one
    ``Mailbox`` per event loop."""

    def __init__(self, loop: EngineLoop, tokenizer, metrics: ServerMetrics, limits: ServerLimits,
                 stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.loop, self.tokenizer, self.metrics, self.limits = loop, tokenizer, metrics, limits
        # Tokens per streamed event after the first: each event costs the event loop a JSON
        # encoding and an SSE write, holding the GIL the engine thread needs between steps
        # (whether fewer events raise the server's rate: docs/benchmarks.md, not on the CPU VM).
        self.stream_interval = stream_interval
        self.mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}

    def mailbox(self) -> Mailbox:
        aloop = asyncio.get_running_loop()
        if self.mailboxes.get(aloop) is None:
            self.mailboxes[aloop] = Mailbox(aloop)
        return self.mailboxes[aloop]

    def start(self, gen: Generation, arrived: float, hidden: tuple[int, ...]) -> list[Choice]:
        """Every choice of ``gen`` submitted, prompt by prompt, ``n`` each (choice ``i * n + j``);
        when one is refused, those already queued are cancelled and the refusal is raised."""
        choices: list[Choice] = []
        try:
            for ids in gen.prompts:
                for j in range(gen.n):
                    choice = Choice(self, ids, gen.choice_params(j), gen.logprobs, arrived, gen.stops, hidden)
                    choice.submit()
                    choices.append(choice)
        except BaseException:
            for choice in choices:
                choice.end("cancelled")
            raise
        return choices

    async def score_prompts(self, gen: Generation) -> list[list[TokenLogprob]]:
        """Each prompt's tokens' log-probabilities (``echo`` with ``logprobs``), computed on the
        engine thread between decode steps."""
        if gen.logprobs is None:
            return [[] for _ in gen.prompts]
        model, limit = self.loop.engine.model, self.loop.engine.max_len
        for ids in gen.prompts:
            if len(ids) > limit:
                raise BadRequest(f"the prompt ({len(ids)} tokens) exceeds the model's context of {limit} tokens",
                                 "prompt")
        futures = [self.loop.call(lambda ids=ids: prompt_logprobs(model, ids, gen.logprobs)) for ids in gen.prompts]
        return [await asyncio.wrap_future(f) for f in futures]


async def merged(sources: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(source index, item) from several async iterators, as their items arrive; an exception of
    one is raised here once the items before it are out."""
    out: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, source: AsyncIterator[Any]) -> None:
        try:
            async for item in source:
                await out.put((i, item))
            await out.put((i, done))
        except Exception as e:
            await out.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    try:
        left = len(tasks)
        while left:
            i, item = await out.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
