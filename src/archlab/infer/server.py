"""``archlab serve``: an OpenAI-compatible completions server on the engine (FastAPI + uvicorn).

    POST /v1/completions   {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed",
                            "stream"; archlab's extras: "top_k", and "speculate" on a server started
                            with --speculate K: the most draft tokens a step may accept, 0..K}
    GET  /v1/models

One thread (``EngineLoop``) owns the engine and its scheduler: requests from any number of HTTP
connections queue there and share the running decode batch, each in a slot of the static KV
cache (continuous batching: a request joins at the next step after a slot frees). Tokens travel
back to each connection's asyncio queue. A streaming response is server-sent events, one
``text_completion`` chunk per piece of text, then ``data: [DONE]``.

A malformed request is answered with a 4xx and an OpenAI-style JSON error before it reaches the
engine, so it never disturbs the others. A client that disconnects cancels its request; the
scheduler frees its slot before the next step.
"""


import asyncio
import json
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from archlab.infer.engine import Engine, Request, Scheduler
from archlab.infer.sampling import SamplingParams
from archlab.infer.speculative import SpeculativeOptions


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class EngineLoop:
    """The engine's thread: takes submitted requests, admits, steps, hands out tokens."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.scheduler = Scheduler(engine)
        self.inbox: queue.Queue[Request] = queue.Queue()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="archlab-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "EngineLoop":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put_nowait(None)  # type: ignore[arg-type]  # wakes a waiting loop
        self.thread.join(timeout=10)

    def submit(self, request: Request) -> None:
        """Validate (raising ValueError for a bad request) and queue for the engine thread."""
        self.scheduler.check(request)
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

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take(block=self.scheduler.idle)
                self.scheduler.admit()
                if any(not r.done for r in self.scheduler.running.values()):
                    self.scheduler.step_once()
        except BaseException as e:  # pragma: no cover - reported to every waiting client
            self.error = e
            for r in list(self.scheduler.running.values()) + list(self.scheduler.waiting):
                r.finish_reason = "error"
                if r.on_token is not None:
                    r.on_token(r, -1)


@dataclass
class Completion:
    """One HTTP request's view of its engine request: tokens arrive on ``tokens``."""

    request: Request
    tokens: asyncio.Queue
    stop_text: tuple[str, ...]


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


def create_app(loop: EngineLoop, tokenizer, model_name: str, eos: int | None = None):
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="archlab", description="OpenAI-compatible completions on the archlab engine")
    created = int(time.time())
    mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}

    @app.exception_handler(BadRequest)
    async def bad_request(_: HTTPRequest, e: BadRequest):
        return JSONResponse(error_body(e.message, e.param, e.code), status_code=e.status)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "archlab", "max_model_len": loop.engine.max_len}]}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        try:
            body = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        ids, params, stops, stream = parse_completion(body, model_name, tokenizer, eos)
        aloop = asyncio.get_running_loop()
        if mailboxes.get(aloop) is None:
            mailboxes[aloop] = Mailbox(aloop)
        mailbox = mailboxes[aloop]
        tokens: asyncio.Queue = asyncio.Queue()

        def on_token(r: Request, token: int) -> None:  # the engine thread
            mailbox.post(tokens, (token, r.finish_reason))

        request = Request(ids, params, on_token=on_token)
        try:
            loop.submit(request)
        except ValueError as e:
            param = "speculate" if str(e).startswith("speculate") else "prompt" if "prompt" in str(e) else "max_tokens"
            raise BadRequest(str(e), param) from None
        ident, now = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {"id": ident, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

        async def pieces() -> AsyncIterator[tuple[str, str | None]]:
            """(new text, finish reason or None) per batch of the tokens that have arrived, until
            the request ends: a stream that falls behind catches up in fewer, larger chunks."""
            text = TextStream(tokenizer, stops, eos)
            try:
                while True:
                    arrived = [await tokens.get()]
                    while not tokens.empty():
                        arrived.append(tokens.get_nowait())
                    parts = []
                    for token, finish in arrived:
                        if token < 0:
                            raise RuntimeError(f"the engine failed: {loop.error!r}")
                        parts.append(text.add(token, final=finish is not None))
                        if text.stopped:
                            request.cancelled = True  # frees the slot; the stop string ends it
                            yield "".join(parts), "stop"
                            return
                        if finish is not None:
                            yield "".join(parts), "stop" if finish == "stop" else "length"
                            return
                    if any(parts):
                        yield "".join(parts), None
            finally:
                request.cancelled = request.cancelled or not request.done  # a dropped client

        def usage() -> dict[str, int]:
            n = len(request.tokens)
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        if stream:
            options = body.get("stream_options") or {}
            with_usage = isinstance(options, dict) and bool(options.get("include_usage"))

            async def events():
                try:
                    async for delta, finish in pieces():
                        yield f"data: {json.dumps(chunk(delta, finish))}\n\n"
                    if with_usage:  # OpenAI's stream_options.include_usage: one more chunk, no choices
                        yield f"data: {json.dumps({**chunk('', None), 'choices': [], 'usage': usage()})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:  # the client went away mid-stream: free the slot now
                    if not request.done:
                        request.cancelled = True

            return StreamingResponse(events(), media_type="text/event-stream")
        parts, finish = [], None
        async for delta, finish in pieces():
            parts.append(delta)
        return {**chunk("".join(parts), finish), "usage": usage()}

    return app


def serve(ckpt: str, host: str = "127.0.0.1", port: int = 8000, slots: int = 16, device: str = "auto",
          dtype: str = "auto", model_name: str | None = None, warm_up: bool = True,
          speculate: SpeculativeOptions | None = None) -> None:
    """Load a checkpoint and serve it until interrupted; ``speculate``: self-speculative decoding
    (checked against the model before the server listens)."""
    import uvicorn

    from archlab.infer.loading import load_for_inference

    model, tokenizer, eos, name = load_for_inference(ckpt, device, dtype)
    engine = Engine(model, slots=slots, speculate=speculate)  # a bad --speculate fails here, before listening
    spec = engine.speculative
    how = f", self-speculative: {spec.draft_tokens} tokens drafted by {spec.draft_layers} layer visits" if spec else ""
    print(f"archlab: serving {ckpt} on http://{host}:{port}/v1 ({slots} slots{how})", file=sys.stderr)
    if warm_up:
        # Short prompts for every group size that requests can arrive in; longer buckets compile
        # on first use.
        engine.warm_up(buckets=(16,), batch_sizes=engine.group_sizes())
    loop = EngineLoop(engine).start()
    try:
        uvicorn.run(create_app(loop, tokenizer, model_name or name, eos), host=host, port=port, log_level="warning")
    finally:
        loop.stop()
