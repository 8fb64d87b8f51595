"""``archlab serve``: an OpenAI-compatible completions server on the engine (FastAPI + uvicorn).

    POST /v1/completions   {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed",
                            "stream"; archlab's extras: "top_k", and "speculate" on a server started
                            with --speculate K: the most draft tokens a step may accept, 0..K}
    GET  /v1/models
    GET  /health           {"status": "ok"}, 503 once the engine has failed; needs no API key
    GET  /metrics          Prometheus text format (``infer.metrics``)

One thread (``EngineLoop``) owns the engine and its scheduler: requests from any number of HTTP
connections queue there and share the running decode batch, each in a slot of the static KV
cache (continuous batching: a request joins at the next step after a slot frees). Tokens travel
back to each connection's asyncio queue. A streaming response is server-sent events, one
``text_completion`` chunk per piece of text, then ``data: [DONE]``.

A malformed request is answered with a 4xx and an OpenAI-style JSON error before it reaches the
engine, so it never disturbs the others. Facing a network (``infer.server_limits``): an API key
on every route but /health (401), a body size limit (413), a bounded wait queue (429 with
Retry-After past ``--max-queue`` waiting requests), and a time limit per request, past which it
ends with the text so far and finish_reason "length". A client that disconnects, streaming or
not, cancels its request; the scheduler frees its slot before the next step.
"""


import asyncio
import json
import queue
import sys
import threading
import time
import uuid
from collections import deque
from typing import Any, AsyncIterator, Callable

from archlab.infer.engine import Engine, Request, Scheduler
from archlab.infer.metrics import CONTENT_TYPE, ServerMetrics
from archlab.infer.sampling import SamplingParams
from archlab.infer.server_limits import (RETRY_AFTER_S, BodyTooLarge, Guard, ServerLimits, bind, error_body,
                                         exposure_warning, listening_url)
from archlab.infer.speculative import SpeculativeOptions


class BadRequest(Exception):
    """A request answered with a 4xx and an OpenAI-style error before it reaches the engine."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.kind, self.headers = kind, headers


class QueueFull(Exception):
    """Every slot is busy and ``max_waiting`` requests already wait for one."""


class EngineFailed(Exception):
    """The engine thread died; no request can run any more."""


class EngineLoop:
    """The engine's thread: takes submitted requests, admits, steps, hands out tokens.

    It also keeps the counts that bound the wait queue and that /metrics reports: requests
    waiting for a slot (``queue_length``), slots holding a request (``slots_in_use``) and both
    together (``in_engine``). Handlers add to ``in_engine`` as they submit; the engine thread
    recounts all three after each admission, under the same lock, so a burst of submissions
    between two steps cannot pass the bound."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.scheduler = Scheduler(engine)
        self.inbox: queue.Queue[Request] = queue.Queue()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="archlab-engine", daemon=True)
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self.in_engine = self.queue_length = self.slots_in_use = 0

    def start(self) -> "EngineLoop":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put_nowait(None)  # type: ignore[arg-type]  # wakes a waiting loop
        self.thread.join(timeout=10)

    def submit(self, request: Request, max_waiting: int | None = None) -> None:
        """Validate (raising ValueError for a bad request) and queue for the engine thread;
        ``QueueFull`` when every slot is busy and ``max_waiting`` requests wait already."""
        self.scheduler.check(request)
        with self._lock:
            if self.error is not None:
                raise EngineFailed(f"the engine failed: {self.error!r}")
            if max_waiting is not None and self.in_engine >= self.engine.slots + max_waiting:
                raise QueueFull(f"the server is busy: every slot is decoding and the queue of {max_waiting} "
                                f"waiting requests is full (--max-queue); retry later")
            self.in_engine += 1
            self.queue_length += 1
            self.inbox.put(request)

    def _take(self, block: bool) -> None:
        try:
            r = self.inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while r is not None:
            self.scheduler.waiting.append(r)
            try:
                r = self.inbox.get_nowait()
            except queue.Empty:
                r = None

    def _drop_cancelled(self) -> None:
        """Requests cancelled while they wait (their client left or their time ran out) leave the
        queue now: the scheduler drops them only when a slot frees, and until then they would
        count against ``--max-queue``."""
        waiting = self.scheduler.waiting
        if any(r.cancelled for r in waiting):
            for r in waiting:
                if r.cancelled:
                    r.finish_reason = "cancelled"
            self.scheduler.waiting = deque(r for r in waiting if not r.cancelled)

    def _recount(self) -> None:
        with self._lock:  # puts into the inbox happen under this lock: its size is exact here
            waiting = self.inbox.qsize() + len(self.scheduler.waiting)
            self.queue_length, self.slots_in_use = waiting, len(self.scheduler.running)
            self.in_engine = waiting + self.slots_in_use

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take(block=self.scheduler.idle)
                self._drop_cancelled()
                self.scheduler.admit()
                self._recount()
                if any(not r.done for r in self.scheduler.running.values()):
                    self.scheduler.step_once()
        except BaseException as e:  # reported to every request in flight; later ones are refused
            with self._lock:  # no submission after this: each one checks ``error`` under the lock
                self.error = e
            self._take(block=False)
            for r in list(self.scheduler.running.values()) + list(self.scheduler.waiting):
                r.finish_reason = "error"
                if r.on_token is not None:
                    r.on_token(r, -1)


def parse_completion(body: Any, model_name: str, tokenizer, eos: int | None) -> tuple[list[int], SamplingParams, tuple[str, ...], bool]:
    """(prompt ids, sampling, stop strings, stream) from a request body, or ``BadRequest``."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required: the id of a model from /v1/models", "model")
    if model != model_name:
        raise BadRequest(f"the model {model!r} does not exist; this server serves {model_name!r}", "model", 404,
                         "model_not_found")
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            raise BadRequest(f"{key} must be 1 (one completion per request)", key)
    for key in ("logprobs", "suffix"):
        if body.get(key) is not None:
            raise BadRequest(f"{key} is not supported", key)
    if body.get("echo"):
        raise BadRequest("echo is not supported", "echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt).ids if prompt else []
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise BadRequest("prompt must be one string or one list of token ids (batches: one request each)", "prompt")
    if not ids:
        raise BadRequest("the prompt is empty", "prompt")
    if any(t < 0 or t >= tokenizer.get_vocab_size() for t in ids):
        raise BadRequest("a prompt token id is outside the vocabulary", "prompt")

    def number(key: str, default: Any, kind: type) -> Any:
        value = body.get(key, default)
        if value is None:
            return default
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is int:
            ok = ok and float(value).is_integer()
        if not ok:
            raise BadRequest(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}", key)
        return kind(value)

    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise BadRequest("stop must be a string or a list of up to 4 non-empty strings", "stop")
    params = SamplingParams(max_new_tokens=number("max_tokens", 16, int), temperature=number("temperature", 1.0, float),
                            top_k=number("top_k", 0, int), top_p=number("top_p", 1.0, float),
                            stop_tokens=(eos,) if eos is not None else (), seed=number("seed", 0, int),
                            speculate=number("speculate", None, int))
    try:
        params.check()
    except ValueError as e:
        raise BadRequest(str(e), str(e).split()[0]) from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)):
        raise BadRequest("stream_options must be an object like {\"include_usage\": true}", "stream_options")
    return ids, params, stops, stream


_WINDOW = 6  # tokens of already-decoded context each incremental decode starts from


class TextStream:
    """Incremental detokenisation: the new text after each token, cut at the first stop string
    (which is not returned). Until the last token it holds back an incomplete UTF-8 character and
    any tail that could still grow into a stop string, so no text sent is ever taken back.

    Each token decodes a short window, not the whole sequence: decoding every stream's full text
    at every step cost O(length) per token, in the one process that serves every stream. The
    window starts a few decoded tokens back, because a decoder may render a token differently at
    the start of a text (a leading space dropped, a byte sequence cut); the new text is what the
    window adds to the decode of its first part (as Hugging Face's and vLLM's incremental
    detokenisers do), and the whole text is decoded once where that does not hold."""

    def __init__(self, tokenizer, stops: tuple[str, ...], eos: int | None):
        self.tokenizer, self.stops, self.eos = tokenizer, stops, eos
        self.ids: list[int] = []
        self.read = 0  # ids[:read] are in ``decoded``; ids[read:] not yet
        self.decoded = ""  # the text of ids[:read]
        self.sent = ""
        self.stopped = False

    def _advance(self, final: bool) -> str:
        """The complete text of the tokens since the last call ("" while a character is unfinished)."""
        start = max(0, self.read - _WINDOW)
        before = self.tokenizer.decode(self.ids[start:self.read])
        while not before and start > 0:  # tokens that decode to nothing (special ones) give no anchor
            start = max(0, start - _WINDOW)
            before = self.tokenizer.decode(self.ids[start:self.read])
        window = self.tokenizer.decode(self.ids[start:])
        if window.endswith("\ufffd") and not final:
            return ""
        self.read = len(self.ids)
        if window.startswith(before):
            return window[len(before):]
        # A decoder whose text for the window's first tokens changed with what followed: the
        # whole text once, which is always right.
        return self.tokenizer.decode(self.ids)[len(self.decoded):]

    def add(self, token: int, final: bool = False) -> str:
        if token != self.eos:
            self.ids.append(token)
        return self._new_text(final)

    def close(self) -> str:
        """The text still held back when a stream ends without a last token (its time limit):
        an unfinished character (as U+FFFD), a tail that did not become a stop string."""
        return "" if self.stopped else self._new_text(final=True)

    def _new_text(self, final: bool) -> str:
        self.decoded += self._advance(final)
        text = self.decoded
        # A stop string starting before ``lo`` would have ended inside the text already sent.
        lo = max(0, len(self.sent) - max((len(s) for s in self.stops), default=0))
        cuts = [i for i in (text.find(s, lo) for s in self.stops) if i >= 0]
        if cuts:
            text, self.stopped = text[: min(cuts)], True
        elif not final:
            hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - hold]
        delta, self.sent = text[len(self.sent):], text
        return delta


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
CLIENT_GONE = 499  # nginx's "client closed request": the status of an answer nobody reads, for the logs


async def until_disconnected(http, work) -> tuple[bool, Any]:
    """(True, ``work``'s result), or (False, None) when the client disconnects first: ``work`` is
    then cancelled. Only for a response not yet started: uvicorn reports a disconnect through
    ``receive`` (a streaming response listens there itself), never by cancelling the handler."""

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            t.cancel()
    await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


def create_app(loop: EngineLoop, tokenizer, model_name: str, eos: int | None = None,
               limits: ServerLimits = ServerLimits()):
    """The FastAPI app on ``loop``; its metrics are ``app.state.metrics``."""
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.requests import ClientDisconnect

    class EndingStream(StreamingResponse):
        """Server-sent events that call ``on_end`` however the response ends. Here rather than
        in the events' generator: a client gone before the stream starts never runs the
        generator, so a ``finally`` there would never free the slot."""

        def __init__(self, events: AsyncIterator[str], on_end: Callable[[], None]):
            super().__init__(events, media_type="text/event-stream")
            self.on_end = on_end

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_end()

    app = FastAPI(title="archlab", description="OpenAI-compatible completions on the archlab engine")
    created = int(time.time())
    mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}
    metrics = app.state.metrics = ServerMetrics(loop.engine.slots, lambda: loop.queue_length,
                                                lambda: loop.slots_in_use)
    app.add_middleware(Guard, limits=limits, count=lambda outcome: metrics.requests.inc(value=outcome))

    @app.exception_handler(BadRequest)
    async def bad_request(_: HTTPRequest, e: BadRequest):
        metrics.requests.inc(value={413: "too_large", 429: "queue_full"}.get(e.status, "invalid"))
        return JSONResponse(error_body(e.message, e.param, e.code, e.kind), status_code=e.status, headers=e.headers)

    @app.exception_handler(EngineFailed)
    async def engine_failed(_: HTTPRequest, e: EngineFailed):
        return JSONResponse(error_body(str(e), code="engine_failed", kind="server_error"), status_code=503)

    @app.exception_handler(BodyTooLarge)
    async def too_large(_: HTTPRequest, e: BodyTooLarge):
        metrics.requests.inc(value="too_large")
        return JSONResponse(error_body(str(e), code="request_too_large"), status_code=413)

    @app.get("/health")
    async def health():
        if loop.error is not None or not loop.thread.is_alive():
            return JSONResponse({"status": "error", "message": "the engine has stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def scrape():
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "archlab", "max_model_len": loop.engine.max_len}]}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        arrived = time.perf_counter()
        try:
            body = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        except ClientDisconnect:  # gone before its request was read: nothing to answer or cancel
            metrics.requests.inc(value="cancelled")
            return Response(status_code=CLIENT_GONE)
        ids, params, stops, stream = parse_completion(body, model_name, tokenizer, eos)
        aloop = asyncio.get_running_loop()
        if mailboxes.get(aloop) is None:
            mailboxes[aloop] = Mailbox(aloop)
        mailbox = mailboxes[aloop]
        tokens: asyncio.Queue = asyncio.Queue()
        last_token_at: float | None = None

        def on_token(r: Request, token: int) -> None:  # the engine thread
            nonlocal last_token_at
            if token >= 0:
                now = time.perf_counter()
                metrics.generated_tokens.inc()
                if last_token_at is None:
                    metrics.ttft.observe(now - arrived)
                else:
                    metrics.token_latency.observe(now - last_token_at)
                last_token_at = now
            mailbox.post(tokens, (token, r.finish_reason))

        request = Request(ids, params, on_token=on_token)
        try:
            loop.submit(request, max_waiting=limits.max_queue)
        except QueueFull as e:
            raise BadRequest(str(e), None, 429, "queue_full", "server_busy",
                             {"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineFailed:
            metrics.requests.inc(value="error")
            raise
        except ValueError as e:
            param = "speculate" if str(e).startswith("speculate") else "prompt" if "prompt" in str(e) else "max_tokens"
            raise BadRequest(str(e), param) from None
        metrics.started()
        metrics.prompt_tokens.inc(len(ids))
        timer = None
        if limits.request_timeout is not None:
            left = limits.request_timeout - (time.perf_counter() - arrived)
            timer = aloop.call_later(max(0.0, left), tokens.put_nowait, (TIME_UP, None))
        ending: list[str] = []  # the outcome, once decided
        delivered = 0  # tokens whose text reached the response (the usage counts these)

        def end(outcome: str) -> None:
            """Record how the request ended, once; a request still in the engine (its client
            left, its time ran out, a stop string cut it) is cancelled: its slot frees."""
            if ending:
                return
            ending.append(outcome)
            if timer is not None:
                timer.cancel()
            if not request.done:
                request.cancelled = True
            metrics.ended(outcome, time.perf_counter() - arrived)

        ident, now = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {"id": ident, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

        async def pieces() -> AsyncIterator[tuple[str, str | None]]:
            """(new text, finish reason or None) per batch of the tokens that have arrived, until
            the request ends: a stream that falls behind catches up in fewer, larger chunks."""
            nonlocal delivered
            text = TextStream(tokenizer, stops, eos)
            while True:
                arrived_now = [await tokens.get()]
                while not tokens.empty():
                    arrived_now.append(tokens.get_nowait())
                parts = []
                for token, finish in arrived_now:
                    if token == TIME_UP:  # the text so far ends it, as max_tokens would have
                        end("timeout")
                        yield "".join(parts) + text.close(), "length"
                        return
                    if token < 0:
                        end("error")
                        raise EngineFailed(f"the engine failed: {loop.error!r}")
                    delivered += 1
                    parts.append(text.add(token, final=finish is not None))
                    if text.stopped:  # the stop string ends it; ``end`` frees the slot
                        end("stop")
                        yield "".join(parts), "stop"
                        return
                    if finish is not None:
                        end("stop" if finish == "stop" else "length")
                        yield "".join(parts), "stop" if finish == "stop" else "length"
                        return
                if any(parts):
                    yield "".join(parts), None

        def usage() -> dict[str, int]:
            return {"prompt_tokens": len(ids), "completion_tokens": delivered, "total_tokens": len(ids) + delivered}

        if stream:
            options = body.get("stream_options") or {}
            with_usage = isinstance(options, dict) and bool(options.get("include_usage"))

            async def events():
                try:
                    async for delta, finish in pieces():
                        yield f"data: {json.dumps(chunk(delta, finish))}\n\n"
                except EngineFailed as e:  # the status is sent already: the error is the last event
                    yield f"data: {json.dumps(error_body(str(e), code='engine_failed', kind='server_error'))}\n\n"
                    return
                if with_usage:  # OpenAI's stream_options.include_usage: one more chunk, no choices
                    yield f"data: {json.dumps({**chunk('', None), 'choices': [], 'usage': usage()})}\n\n"
                yield "data: [DONE]\n\n"

            return EndingStream(events(), lambda: end("cancelled"))

        async def collect() -> tuple[str, str | None]:
            parts, finish = [], None
            async for delta, finish in pieces():
                parts.append(delta)
            return "".join(parts), finish

        try:
            answered, result = await until_disconnected(http, collect())
        finally:
            end("cancelled")
        if not answered:
            return Response(status_code=CLIENT_GONE)
        text, finish = result
        return {**chunk(text, finish), "usage": usage()}

    return app


def serve(ckpt: str, host: str = "127.0.0.1", port: int = 8000, slots: int = 16, device: str = "auto",
          dtype: str = "auto", model_name: str | None = None, warm_up: bool = True,
          speculate: SpeculativeOptions | None = None, limits: ServerLimits = ServerLimits()) -> None:
    """Load a checkpoint and serve it until interrupted; ``speculate``: self-speculative decoding
    (checked against the model before the server listens); ``limits``: the API key and the
    bounds on each request's work.

    The checkpoint and the engine's options are checked first, then the port is bound (a port in
    use fails in one line, before the warm-up's compilations), and the "serving" line comes only
    once the socket listens."""
    import uvicorn

    from archlab.infer.loading import load_for_inference

    limits.check()
    model, tokenizer, eos, name = load_for_inference(ckpt, device, dtype)
    engine = Engine(model, slots=slots, speculate=speculate)  # a bad --speculate fails here, before listening
    sock = bind(host, port)
    try:
        if warm_up:
            # Short prompts for every group size that requests can arrive in; longer buckets
            # compile on first use.
            engine.warm_up(buckets=(16,), batch_sizes=engine.group_sizes())
        loop = EngineLoop(engine).start()
        try:
            app = create_app(loop, tokenizer, model_name or name, eos, limits)
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
            sock.listen(2048)  # uvicorn's backlog
            spec = engine.speculative
            how = (f", self-speculative: {spec.draft_tokens} tokens drafted by {spec.draft_layers} layer visits"
                   if spec else "")
            warning = exposure_warning(sock, limits.api_key)
            if warning:
                print(warning, file=sys.stderr)
            print(f"archlab: serving {ckpt} on {listening_url(sock)}/v1 ({slots} slots{how})", file=sys.stderr,
                  flush=True)
            try:
                server.run(sockets=[sock])
            except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once its connections are closed
                print("archlab: interrupted; the server has stopped", file=sys.stderr)
                raise SystemExit(130) from None
        finally:
            loop.stop()
    finally:
        sock.close()
