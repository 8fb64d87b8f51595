"""``archlab serve``: an OpenAI-compatible server on the engine (FastAPI + uvicorn).

    POST /v1/completions        {"model", "prompt" (a string, token ids, or a list of either),
                                 "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
                                 "n", "best_of" (= n), "logprobs", "echo", "presence_penalty",
                                 "frequency_penalty", "logit_bias"; archlab's extras: "top_k", and
                                 "speculate" on a server started with --speculate K}
    POST /v1/chat/completions   {"messages", ...the same sampling fields, "logprobs" (bool),
                                 "top_logprobs"}: rendered with the checkpoint's chat template
    GET  /v1/models, /v1/models/{id}
    GET  /health                {"status": "ok"}, 503 once the engine has failed; needs no API key
    GET  /metrics               Prometheus text format (``infer.metrics``)

Request bodies are checked in ``infer.openai_api`` (and ``infer.chat``); log-probabilities come
from ``infer.logprobs``. One thread (``EngineLoop``) owns the engine and its scheduler: requests
from any number of HTTP connections queue there and share the running decode batch, each in a
slot of the static KV cache (continuous batching: a request joins at the next step after a slot
frees). Each choice of a response (n per prompt, for every prompt of a list) is one engine
request. Tokens travel back to each choice's asyncio queue. A streaming response is server-sent
events, one chunk per piece of text of a choice, then ``data: [DONE]``.

A malformed request is answered with a 4xx and an OpenAI-style JSON error before it reaches the
engine, so it never disturbs the others. Facing a network (``infer.server_limits``): an API key
on every route but /health (401), a body size limit (413), a bounded wait queue (429 with
Retry-After past ``--max-queue`` waiting requests), and a time limit per request, past which it
ends with the text so far and finish_reason "length". A client that disconnects, streaming or
not, cancels its request; the scheduler frees its slots before the next step.
"""


import asyncio
import json
import sys
import time
import uuid
from typing import Any, AsyncIterator, Callable

from archlab.infer.chat import ChatTemplate, load_chat_template, parse_chat
from archlab.infer.engine import Engine
from archlab.infer.engine_loop import EngineFailed, EngineLoop, QueueFull  # noqa: F401  # the server's API
from archlab.infer.logprobs import TokenLogprob, chat_logprobs, legacy_logprobs
from archlab.infer.metrics import CONTENT_TYPE, ServerMetrics
from archlab.infer.openai_api import BadRequest, Generation, parse_completion
from archlab.infer.server_limits import (BodyTooLarge, Guard, ServerLimits, bind, error_body, exposure_warning,
                                         listening_url)
from archlab.infer.speculative import SpeculativeOptions
from archlab.infer.streams import Choice, Serving, TextStream, merged  # noqa: F401  # TextStream: the server's API

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
               limits: ServerLimits = ServerLimits(), chat_template: ChatTemplate | None = None,
               stream_interval: int = 1):
    """The FastAPI app on ``loop``; its metrics are ``app.state.metrics``. ``chat_template``: the
    checkpoint's (``infer.chat``); without one, chat requests get a 400. ``stream_interval``:
    tokens per streamed event after the first (``streams.Choice.pieces``)."""
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

    app = FastAPI(title="archlab", description="OpenAI-compatible completions and chat on the archlab engine")
    created = int(time.time())
    metrics = app.state.metrics = ServerMetrics(loop.engine.slots, lambda: loop.queue_length,
                                                lambda: loop.slots_in_use)
    serving = Serving(loop, tokenizer, metrics, limits, stream_interval)
    app.add_middleware(Guard, limits=limits, count=lambda outcome: metrics.requests.inc(value=outcome))
    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "archlab",
                  "max_model_len": loop.engine.max_len}

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
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        if model_id != model_name:
            raise BadRequest(f"the model {model_id!r} does not exist; this server serves {model_name!r}", "model",
                             404, "model_not_found")
        return model_card

    async def read_body(http: HTTPRequest) -> Any:
        try:
            return json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None

    def usage(gen: Generation, choices: list[Choice]) -> dict[str, int]:
        prompt = sum(len(ids) for ids in gen.prompts)
        done = sum(c.delivered for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    async def respond(http: HTTPRequest, gen: Generation, choices: list[Choice],
                      chunk: Callable[[int, str, str | None, list[TokenLogprob], bool], dict],
                      whole: Callable[[int, tuple[str, str | None, list[TokenLogprob]]], dict], kind: str):
        """The response to ``choices`` already submitted: server-sent ``chunk``s of every choice
        as they come, or once all have ended, one body of their ``whole`` results."""
        ident, now = f"{kind}-{uuid.uuid4().hex[:24]}", int(time.time())
        frame = {"id": ident, "object": "chat.completion" if kind == "chatcmpl" else "text_completion",
                 "created": now, "model": model_name}

        def end_all(outcome: str) -> None:
            for c in choices:
                c.end(outcome)

        if gen.stream:
            frame["object"] += ".chunk" if kind == "chatcmpl" else ""

            # Every event is this frame with one choice: its JSON text is made once, and each
            # event adds only its choice's (one json.dumps of a small dict per token and stream).
            head = "data: " + json.dumps({**frame, "choices": []})[:-2]  # ends with '"choices": ['

            def event(choice: dict) -> str:
                return f"{head}{json.dumps(choice)}]}}\n\n"

            async def events():
                for i in range(len(choices)):  # each choice's opening chunk (chat: its role)
                    first = chunk(i, "", None, [], True)
                    if first:
                        yield event(first)
                # one choice (the usual request) is read directly; several are interleaved
                source = (((0, piece) async for piece in choices[0].pieces()) if len(choices) == 1
                          else merged([c.pieces() for c in choices]))
                try:
                    async for i, (delta, finish, entries) in source:
                        yield event(chunk(i, delta, finish, entries, False))
                except EngineFailed as e:  # the status is sent already: the error is the last event
                    yield f"data: {json.dumps(error_body(str(e), code='engine_failed', kind='server_error'))}\n\n"
                    return
                if gen.include_usage:  # OpenAI's stream_options.include_usage: one more chunk, no choices
                    yield f"data: {json.dumps({**frame, 'choices': [], 'usage': usage(gen, choices)})}\n\n"
                yield "data: [DONE]\n\n"

            return EndingStream(events(), lambda: end_all("cancelled"))

        async def all_results():
            return await asyncio.gather(*(c.collect() for c in choices))

        try:
            answered, results = await until_disconnected(http, all_results())
        finally:
            end_all("cancelled")
        if not answered:
            return Response(status_code=CLIENT_GONE)
        return {**frame, "choices": [whole(i, r) for i, r in enumerate(results)], "usage": usage(gen, choices)}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        arrived = time.perf_counter()
        try:
            body = await read_body(http)
        except ClientDisconnect:  # gone before its request was read: nothing to answer or cancel
            metrics.requests.inc(value="cancelled")
            return Response(status_code=CLIENT_GONE)
        gen = parse_completion(body, model_name, tokenizer, eos)
        scored = await serving.score_prompts(gen) if gen.echo else [[] for _ in gen.prompts]
        prompt_of = lambda i: i // gen.n  # noqa: E731  # choice i * n + j belongs to prompt i
        # text_offset counts from the start of the prompt; an echoed prompt's text comes first
        start = [len(t) for t in gen.prompt_texts] if gen.echo else [
            len(tokenizer.decode(ids, skip_special_tokens=False)) if gen.logprobs is not None else 0
            for ids in gen.prompts]
        if not gen.generates:  # echo with max_tokens 0: the prompts scored, nothing generated
            metrics.started()
            metrics.ended("length", time.perf_counter() - arrived)
            count = len(gen.prompts) * gen.n
            return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                    "model": model_name,
                    "choices": [{"text": gen.prompt_texts[prompt_of(i)], "index": i, "finish_reason": "length",
                                 "logprobs": None if gen.logprobs is None else
                                 legacy_logprobs(tokenizer, scored[prompt_of(i)], 0)} for i in range(count)],
                    "usage": {"prompt_tokens": sum(map(len, gen.prompts)), "completion_tokens": 0,
                              "total_tokens": sum(map(len, gen.prompts))}}
        choices = serving.start(gen, arrived, (eos,) if eos is not None else ())
        offsets = [start[prompt_of(i)] for i in range(len(choices))]  # per choice, as its stream advances

        def logprobs(i: int, entries: list[TokenLogprob]) -> dict | None:
            if gen.logprobs is None:
                return None
            out = legacy_logprobs(tokenizer, entries, offsets[i])
            offsets[i] += sum(len(t) for t in out["tokens"])
            return out

        def chunk(i: int, delta: str, finish: str | None, entries: list[TokenLogprob], opening: bool) -> dict | None:
            if opening:  # an echoed prompt opens its choice's stream
                if not gen.echo:
                    return None
                delta, entries = gen.prompt_texts[prompt_of(i)], scored[prompt_of(i)]
                offsets[i] = 0
            return {"text": delta, "index": i, "logprobs": logprobs(i, entries), "finish_reason": finish}

        def whole(i: int, result: tuple[str, str | None, list[TokenLogprob]]) -> dict:
            text, finish, entries = result
            if gen.echo:
                text, entries, offsets[i] = gen.prompt_texts[prompt_of(i)] + text, scored[prompt_of(i)] + entries, 0
            return {"text": text, "index": i, "logprobs": logprobs(i, entries), "finish_reason": finish}

        return await respond(http, gen, choices, chunk, whole, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        arrived = time.perf_counter()
        try:
            body = await read_body(http)
        except ClientDisconnect:
            metrics.requests.inc(value="cancelled")
            return Response(status_code=CLIENT_GONE)
        gen = parse_chat(body, model_name, chat_template, loop.engine.max_len)
        assert chat_template is not None  # parse_chat refuses a model without one
        choices = serving.start(gen, arrived, chat_template.stop_tokens)

        def logprobs(entries: list[TokenLogprob]) -> dict | None:
            return None if gen.logprobs is None else chat_logprobs(tokenizer, entries)

        def chunk(i: int, delta: str, finish: str | None, entries: list[TokenLogprob], opening: bool) -> dict:
            if opening:
                return {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
            return {"index": i, "delta": {"content": delta} if delta or finish is None else {},
                    "logprobs": logprobs(entries), "finish_reason": finish}

        def whole(i: int, result: tuple[str, str | None, list[TokenLogprob]]) -> dict:
            text, finish, entries = result
            return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs(entries),
                    "finish_reason": finish}

        return await respond(http, gen, choices, chunk, whole, "chatcmpl")

    return app


def serve(ckpt: str, host: str = "127.0.0.1", port: int = 8000, slots: int = 16, device: str = "auto",
          dtype: str = "auto", model_name: str | None = None, warm_up: bool = True,
          speculate: SpeculativeOptions | None = None, limits: ServerLimits = ServerLimits(),
          stream_interval: int = 1) -> None:
    """Load a checkpoint and serve it until interrupted; ``speculate``: self-speculative decoding
    (checked against the model before the server listens); ``limits``: the API key and the
    bounds on each request's work; ``stream_interval``: tokens per streamed event after the first.

    The checkpoint and the engine's options are checked first, then the port is bound (a port in
    use fails in one line, before the warm-up's compilations), and the "serving" line comes only
    once the socket listens."""
    import uvicorn

    from archlab.infer.loading import load_for_inference

    from archlab.io.checkpoint import resolve_checkpoint

    limits.check()
    model, tokenizer, eos, name = load_for_inference(ckpt, device, dtype)
    template = load_chat_template(resolve_checkpoint(ckpt), tokenizer, eos)  # a broken one fails here
    engine = Engine(model, slots=slots, speculate=speculate)  # a bad --speculate fails here, before listening
    sock = bind(host, port)
    try:
        if warm_up:
            # Short prompts for every group size that requests can arrive in; longer buckets
            # compile on first use.
            engine.warm_up(buckets=(16,), batch_sizes=engine.group_sizes())
        loop = EngineLoop(engine).start()
        try:
            app = create_app(loop, tokenizer, model_name or name, eos, limits, template, stream_interval)
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
            sock.listen(2048)  # uvicorn's backlog
            spec = engine.speculative
            how = (f", self-speculative: {spec.draft_tokens} tokens drafted by {spec.draft_layers} layer visits"
                   if spec else "")
            warning = exposure_warning(sock, limits.api_key)
            if warning:
                print(warning, file=sys.stderr)
            chat = "chat template" if template else "no chat template: /v1/chat/completions answers 400"
            print(f"archlab: serving {ckpt} on {listening_url(sock)}/v1 ({slots} slots{how}; {chat})",
                  file=sys.stderr, flush=True)
            try:
                server.run(sockets=[sock])
            except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once its connections are closed
                print("archlab: interrupted; the server has stopped", file=sys.stderr)
                raise SystemExit(130) from None
        finally:
            loop.stop()
    finally:
        sock.close()
