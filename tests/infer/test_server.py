"""``archlab serve`` driven by the official ``openai`` client against a tiny trained checkpoint:
completions, streaming, concurrent streams equal to sequential generation, 4xx errors that leave
the server serving, and a dropped client's slot freed."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from archlab.infer.engine import Engine  # noqa: E402
from archlab.infer.loading import load_for_inference  # noqa: E402
from archlab.infer.sampling import SamplingParams  # noqa: E402
from archlab.infer.server import EngineLoop, create_app  # noqa: E402
from tests.helpers import slow_down  # noqa: E402

SLOTS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(engine: Engine, tok, eos: int | None, **app_options) -> Iterator[tuple[EngineLoop, int]]:
    """The real app on uvicorn in a thread, on a free port: (the engine loop, the port);
    ``app_options``: ``create_app``'s (``limits``)."""
    loop = EngineLoop(engine).start()
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(loop, tok, "tiny", eos, **app_options), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        yield loop, port
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        loop.stop()


@pytest.fixture(scope="module")
def served(tiny_run):
    model, tok, eos, _ = load_for_inference(tiny_run, "cpu", "float32")
    with running_server(Engine(model, slots=SLOTS), tok, eos) as (loop, port):
        client = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=60)
        yield client, model, tok, eos, loop, port


def expected(model, tok, eos, prompt: str, max_tokens: int, **sampling) -> str:
    """What sequential generation in a one-slot engine gives for the same request."""
    params = SamplingParams(max_new_tokens=max_tokens, stop_tokens=(eos,), **sampling)
    r = Engine(model, slots=1).generate([tok.encode(prompt).ids], params)[0]
    return tok.decode([t for t in r.tokens if t != eos])


def test_models_and_a_completion(served):
    client, model, tok, eos, *_ = served
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="def main(", max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason in ("length", "stop")
    assert out.choices[0].text == expected(model, tok, eos, "def main(", 12, temperature=0.0)
    assert out.usage.prompt_tokens == len(tok.encode("def main(").ids) and 1 <= out.usage.completion_tokens <= 12


def test_streaming_gives_the_same_text(served):
    client, model, tok, eos, *_ = served
    chunks = list(client.completions.create(model="tiny", prompt="import os\n", max_tokens=16, temperature=0,
                                            stream=True))
    assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks) == expected(model, tok, eos, "import os\n", 16, temperature=0.0)


@pytest.mark.parametrize("interval", [1, 4])
def test_stream_interval_sends_fewer_larger_events_with_the_same_text(tiny_run, interval):
    """``--stream-interval N``: with one token per decode step (a slow step, so tokens do not
    pile up between events), the first token's event goes at once and the rest come N tokens at
    a time; the text is what interval 1 and a non-streamed request give."""
    model, tok, eos, _ = load_for_inference(tiny_run, "cpu", "float32")
    engine = slow_down(Engine(model, slots=1), 0.02)
    prompt, n = "import os\n", 17
    want = expected(model, tok, eos, prompt, n, temperature=0.0)
    with running_server(engine, tok, eos, stream_interval=interval) as (_, port):
        client = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=60)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    m = chunks[-1].usage.completion_tokens
    assert "".join(texts) == want and m >= 9
    events = [t for t in texts if t]
    if interval == 1:
        assert len(events) >= m // 2  # one event per step, less tokens whose text is held back
    else:  # the first at once, then the rest in events of 4 (the last may be shorter)
        assert 2 <= len(events) <= 1 + -(-(m - 1) // interval) + 1


def test_a_stream_interval_below_one_is_refused():
    from archlab.infer.streams import Serving

    with pytest.raises(ValueError, match="stream_interval"):
        Serving(None, None, None, None, stream_interval=0)


def test_stop_strings_cut_the_text(served):
    client, model, tok, eos, *_ = served
    full = expected(model, tok, eos, "class A:", 24, temperature=0.0)
    assert len(full) > 4
    stop = full[2:4]
    out = client.completions.create(model="tiny", prompt="class A:", max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == full[: full.find(stop)] and out.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_streams_equal_sequential_generation(served):
    """16 streams through 4 slots: they queue, join the running batch as slots free, and each
    gets exactly what it gets alone (sampling is keyed by seed and position, not by batch)."""
    client, model, tok, eos, *_ = served
    jobs = [(f"def f{i}(x):\n    return", 6 + i % 5, dict(temperature=0.0 if i % 2 else 0.9, seed=i, top_p=0.95))
            for i in range(16)]

    def stream(job):
        prompt, n, sp = job
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, stream=True,
                                           temperature=sp["temperature"], seed=sp["seed"], top_p=sp["top_p"])
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(stream, jobs))
    for (prompt, n, sp), text in zip(jobs, got):
        assert text == expected(model, tok, eos, prompt, n, **sp)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(model="gpt-4", prompt="x", max_tokens=4), "NotFoundError", "does not exist"),
    (dict(model="tiny", prompt="x", max_tokens=-3), "BadRequestError", "max_tokens"),
    (dict(model="tiny", prompt="x " * 400, max_tokens=4), "BadRequestError", "context"),
    (dict(model="tiny", prompt="x", max_tokens=4, top_p=1.5), "BadRequestError", "top_p"),
    (dict(model="tiny", prompt="", max_tokens=4), "BadRequestError", "empty"),
    (dict(model="tiny", prompt="x", max_tokens=4, n=2, best_of=3), "BadRequestError", "best_of must equal n"),
    (dict(model="tiny", prompt="x", max_tokens=4, presence_penalty=2.5), "BadRequestError", "presence_penalty"),
    (dict(model="tiny", prompt="x", max_tokens=4, logit_bias={"600": 1}), "BadRequestError", "outside the vocab"),
    (dict(model="tiny", prompt="x", max_tokens=4, logprobs=21), "BadRequestError", "logprobs must be in 0..20"),
    (dict(model="tiny", prompt="x", max_tokens=0), "BadRequestError", "max_tokens must be >= 1"),
    (dict(model="tiny", prompt="x", max_tokens=4, extra_body={"repetition_penalty": 1.2}), "BadRequestError",
     "repetition_penalty is not supported"),
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(served, kwargs, error, words):
    client, *_ = served
    with pytest.raises(getattr(openai, error)) as e:
        client.completions.create(**kwargs)
    assert words in str(e.value)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0).choices[0].text is not None


@pytest.mark.parametrize("body,words", [
    (b"{not json", "not valid JSON"),
    (b'{"prompt": "x"}', "model is required"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 2.5}', "max_tokens must be an integer"),
    (b'{"model": "tiny", "prompt": [1, -2]}', "outside the vocabulary"),
    (b'{"model": "tiny", "prompt": "x", "stream": "yes"}', "stream must be"),
    (b'{"model": "tiny", "prompt": "x", "stream": true, "stream_options": 3}', "stream_options"),
    (b'{"model": "tiny", "prompt": "x", "stop": [""]}', "stop must be"),
    (b'[1, 2]', "JSON object"),
])
def test_malformed_requests_are_400_with_one_message(served, body, words):
    port = served[-1]
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_two_hundred_concurrent_requests_through_four_slots(served):
    """200 requests at once into 4 slots (196 wait in the queue), every other one streamed: each
    completes, none is lost or answered with another's tokens, and each greedy text is what a
    serial run of the same prompts through one slot gives."""
    import asyncio

    client, model, tok, eos, loop, port = served
    jobs = [(f"def g{i}(", 2 + i % 5, i % 2 == 0) for i in range(200)]  # (prompt, max_tokens, stream)
    serial = Engine(model, slots=1)
    want = [tok.decode([t for t in serial.generate([tok.encode(p).ids], SamplingParams(
        max_new_tokens=n, stop_tokens=(eos,), temperature=0.0))[0].tokens if t != eos]) for p, n, _ in jobs]

    async def one(http: httpx.AsyncClient, prompt: str, n: int, stream: bool) -> tuple[str, int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream}
        if not stream:
            r = await http.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]
        body["stream_options"] = {"include_usage": True}
        text, used = [], -1
        async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    text += [c["text"] for c in chunk["choices"]]
                    used = (chunk.get("usage") or {}).get("completion_tokens", used)
        return "".join(text), used

    async def all_of_them() -> list[tuple[str, int]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as http:
            return await asyncio.gather(*(one(http, *job) for job in jobs))

    assert len(set(want)) > 20  # the prompts' texts differ: a request answered with another's would show
    got = asyncio.run(all_of_them())
    assert len(got) == len(jobs)
    for (prompt, n, stream), (text, used), text_alone in zip(jobs, got, want):
        assert text == text_alone and 1 <= used <= n, (prompt, stream, text, text_alone)
    deadline = time.time() + 10  # nothing left behind: no request waits or decodes
    while loop.scheduler.busy or loop.scheduler.waiting:
        assert time.time() < deadline, "requests were left in the scheduler"
        time.sleep(0.05)


def test_a_dropped_client_frees_its_slot(served):
    client, model, tok, eos, loop, port = served
    body = {"model": "tiny", "prompt": "def long(", "max_tokens": 200, "temperature": 0.9, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    # the connection is closed: within a few steps the request is cancelled and its slot free
    deadline = time.time() + 20
    while any(not r.done for r in loop.scheduler.running.values()):
        assert time.time() < deadline, "the dropped request still holds its slot"
        time.sleep(0.05)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0).choices[0].text is not None


def test_stream_usage_chunk(served):
    client, *_ = served
    chunks = list(client.completions.create(model="tiny", prompt="x = ", max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_concurrent_streams_share_the_decode_batch(tiny_run):
    """64 concurrent streaming requests into 64 warmed-up slots, with a deliberately slow decode
    step: they run as one batch (the scheduler's counters: most and mean active slots per decode
    step), and no prefill shape is built while serving (on a GPU each new shape is a compilation
    of seconds that every waiting stream sits through: with 64 slots the warm-up used to skip the
    group of 8 that a batch of 63 needs, and 64 streams got a median time to first token of 11 s).
    A burst admitted together runs as groups padded to those sizes (63 requests: one group of 64),
    and every stream's text is still what it gets alone."""
    import asyncio

    model, tok, eos, _ = load_for_inference(tiny_run, "cpu", "float32")
    engine = Engine(model, slots=64)
    engine.warm_up(buckets=(16,), batch_sizes=engine.group_sizes())
    warmed = set(engine._prefills)
    slow_down(engine, 0.03)

    async def one(client: httpx.AsyncClient, port: int, i: int) -> int:
        body = {"model": "tiny", "prompt": f"def f{i}(", "max_tokens": 24, "temperature": 0.9, "seed": i,
                "stream": True, "stream_options": {"include_usage": True}}
        n, text = 0, []
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                text += [c["text"] for c in chunk["choices"]]
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
        return n, "".join(text)

    async def all_of_them(port: int) -> list[tuple[int, str]]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=70)) as client:
            return await asyncio.gather(*(one(client, port, i) for i in range(64)))

    groups = []  # (requests, group size) of every prefill call: bursts are padded to a captured size
    prefill_group = engine._prefill_group

    def recorded(rows, prompts, params, real):
        groups.append((real, len(rows)))
        return prefill_group(rows, prompts, params, real)

    engine._prefill_group = recorded
    with running_server(engine, tok, None) as (loop, port):
        loop.scheduler.reset_stats()
        got = asyncio.run(all_of_them(port))
        assert [n for n, _ in got] == [24] * 64
        # each stream's text is what it gets alone, however its burst was grouped
        for i, (_, text) in enumerate(got):
            alone = Engine(model, slots=1).generate([tok.encode(f"def f{i}(").ids],
                                                    SamplingParams(max_new_tokens=24, temperature=0.9, seed=i))
            assert text == tok.decode(alone[0].tokens), (i, groups)
        assert sum(real for real, _ in groups) == 64 and all(size in (1, 8, 64) for _, size in groups), groups
        sched = loop.scheduler
        assert sched.admitted == 64 and sched.max_active >= 48, (sched.max_active, sched.prefills)
        assert sched.mean_active >= 16, (sched.mean_active, sched.decode_steps, sched.prefills)
        assert set(engine._prefills) == warmed, sorted(set(engine._prefills) - warmed)  # no shape built while serving
