"""``archlab serve`` facing a network: the API key, the body size limit, the bounded wait queue,
the per-request time limit, cancellation of plain requests, /health, /metrics (and its text
format), and the listening socket (a port in use is one line, with no "serving" line before it).

Each server here runs the tiny trained checkpoint in-process on a free loopback port; the tests
that need requests to overlap slow the decode step down with a sleep."""

from __future__ import annotations

import json
import math
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from archlab.errors import ArchlabError  # noqa: E402
from archlab.infer.cli import port_number  # noqa: E402
from archlab.infer.engine import Engine  # noqa: E402
from archlab.infer.loading import load_for_inference  # noqa: E402
from archlab.infer.metrics import Counter, Histogram, ServerMetrics, label_text, number  # noqa: E402
from archlab.infer.sampling import SamplingParams  # noqa: E402
from archlab.infer.server_limits import ServerLimits, bind, exposure_warning  # noqa: E402
from tests.helpers import run_cli, slow_down  # noqa: E402
from tests.infer.test_server import running_server  # noqa: E402

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def tiny(tiny_run):
    model, tok, eos, _ = load_for_inference(tiny_run, "cpu", "float32")
    return model, tok, eos


def slow_engine(model, slots: int, step_s: float) -> Engine:
    """An engine whose decode step takes at least ``step_s``: requests overlap as on a busy server."""
    return slow_down(Engine(model, slots=slots), step_s)


def wait_for(condition, failure: str, seconds: float = 10) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, failure
        time.sleep(0.01)


def completion(port: int, **body) -> httpx.Response:
    """A greedy completion of "def f(" (``body`` adds to or overrides the request's fields)."""
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                      json={"model": "tiny", "prompt": "def f(", "temperature": 0, **body}, timeout=30)


def scrape(port: int, key: str | None = None) -> dict[str, float]:
    """/metrics as {series: value}, after checking every line against the text format."""
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.text
    return parse_exposition(r.text)


def parse_exposition(text: str) -> dict[str, float]:
    """The Prometheus text format, strictly: HELP and TYPE before a family's samples, sample
    names of that family, histogram buckets cumulative with +Inf equal to _count."""
    assert text.endswith("\n")
    values: dict[str, float] = {}
    types: dict[str, str] = {}
    label = r'[a-zA-Z_]\w*="(?:[^"\\]|\\.)*"'  # name="value", the value's quotes and backslashes escaped
    sample = re.compile(rf"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{{{label}(?:,{label})*\}})? (\S+)$")
    family = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            family = line.split()[2]
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name == family and kind in ("counter", "gauge", "histogram"), line
            types[name] = kind
            continue
        m = sample.match(line)
        assert m, f"not a sample line: {line!r}"
        name = m.group(1)
        base = re.sub(r"_(bucket|sum|count)$", "", name) if types.get(family) == "histogram" else name
        assert base == family, (line, family)
        values[name + (m.group(2) or "")] = float(m.group(3).replace("+Inf", "inf"))
    for name, kind in types.items():
        if kind == "histogram":
            buckets = [v for k, v in values.items() if k.startswith(name + "_bucket{")]
            assert buckets == sorted(buckets) and buckets[-1] == values[name + "_count"], name
            assert values[f'{name}_bucket{{le="+Inf"}}'] == values[name + "_count"]
    return values


def outcome(values: dict[str, float], what: str) -> float:
    return values[f'archlab_requests_total{{outcome="{what}"}}']


# ---- the API key ------------------------------------------------------------------------------------
def test_an_api_key_guards_every_route_but_health(tiny):
    model, tok, eos = tiny
    with running_server(Engine(model, slots=2), tok, eos, limits=ServerLimits(api_key=KEY)) as (_, port):
        base = f"http://127.0.0.1:{port}"
        health = httpx.get(f"{base}/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                             ("GET", "/no/such/route")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                            {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
                r = httpx.request(method, base + path, headers=headers, json={"model": "tiny", "prompt": "x"})
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        # the official client sends its api_key as the bearer token
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(api_key="wrong", base_url=f"{base}/v1", max_retries=0).models.list()
        client = openai.OpenAI(api_key=KEY, base_url=f"{base}/v1", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.completions.create(model="tiny", prompt="def f(", max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
        values = scrape(port, KEY)
        assert outcome(values, "unauthorized") == 4 * 5 + 1 and outcome(values, "length") == 1


def test_the_api_key_comes_from_the_environment_and_may_not_be_empty(monkeypatch, capsys):
    """Checked before the checkpoint is read (here: none exists)."""
    from archlab.cli import build_parser
    from archlab.infer.cli import server_limits

    monkeypatch.setenv("ARCHLAB_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--ckpt", "x"])
    assert server_limits(args) == ServerLimits(api_key="from-env")
    args = build_parser().parse_args(["serve", "--ckpt", "x", "--api-key", "flag", "--request-timeout", "0",
                                      "--max-queue", "0", "--max-body-bytes", "10"])
    assert server_limits(args) == ServerLimits(api_key="flag", max_body_bytes=10, max_queue=0, request_timeout=None)
    monkeypatch.setenv("ARCHLAB_API_KEY", "")
    code, _, err = run_cli(capsys, "serve", "--ckpt", "no-such-run", "--port", "0")
    assert code == 2 and "API key is empty" in err and len(err.strip().splitlines()) == 1
    monkeypatch.delenv("ARCHLAB_API_KEY")
    code, _, err = run_cli(capsys, "serve", "--ckpt", "no-such-run", "--api-key", " ", "--port", "0")
    assert code == 2 and "API key is empty" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,words", [
    (["--max-queue", "-1"], "--max-queue: must be at least 0"),
    (["--max-body-bytes", "0"], "--max-body-bytes: must be at least 1"),
    (["--request-timeout", "-2"], "--request-timeout: must be a number at least 0"),
    (["--port", "65536"], "--port: must be a port number in 0..65535"),
])
def test_bad_limits_are_one_line_and_exit_2(capsys, argv, words):
    code, _, err = run_cli(capsys, "serve", "--ckpt", "x", *argv)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_a_reachable_host_without_a_key_warns():
    """Sockets bound but never listening: nothing can connect to them."""
    with bind("127.0.0.1", 0) as local, bind("0.0.0.0", 0) as everywhere:
        assert exposure_warning(local, None) is None
        warning = exposure_warning(everywhere, None)
        assert warning and "0.0.0.0" in warning and "--api-key" in warning and "\n" not in warning
        assert exposure_warning(everywhere, KEY) is None


# ---- bounded work -----------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_413_declared_or_chunked(tiny):
    model, tok, eos = tiny
    with running_server(Engine(model, slots=2), tok, eos, limits=ServerLimits(max_body_bytes=400)) as (_, port):
        url = f"http://127.0.0.1:{port}/v1/completions"
        big = json.dumps({"model": "tiny", "prompt": "x" * 500, "max_tokens": 2}).encode()
        declared = httpx.post(url, content=big, headers={"content-type": "application/json"})

        def pieces():  # no Content-Length: the body arrives chunked and is counted as it comes
            for i in range(0, len(big), 100):
                yield big[i:i + 100]

        chunked = httpx.post(url, content=pieces(), headers={"content-type": "application/json"})
        for r in (declared, chunked):
            assert r.status_code == 413 and "400 bytes" in r.json()["error"]["message"], r.text
        assert completion(port, max_tokens=2).status_code == 200  # a small body still passes
        assert outcome(scrape(port), "too_large") == 2


def test_a_full_queue_answers_429_with_retry_after(tiny):
    """One slot, one place in the queue: a third request is refused at once; a waiting request
    whose client leaves frees its place before the slot frees."""
    model, tok, eos = tiny
    with running_server(slow_engine(model, 1, 0.02), tok, eos, limits=ServerLimits(max_queue=1)) as (loop, port):
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": "tiny", "prompt": "def f(", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as first, httpx.Client(timeout=30) as second, ThreadPoolExecutor(1) as pool:
            with first.stream("POST", url, json=body) as running:
                lines = running.iter_lines()  # kept: a dropped iterator closes the connection
                assert next(lines).startswith("data: ")  # it holds the one slot
                with second.stream("POST", url, json=body):
                    wait_for(lambda: loop.queue_length == 1, "the second request never queued")
                    refused = completion(port, max_tokens=2)
                    assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
                    assert refused.json()["error"]["code"] == "queue_full"
                # the waiting request's client has gone: its place frees while the slot stays busy
                wait_for(lambda: loop.queue_length == 0, "a cancelled request kept its place in the queue")
                assert loop.slots_in_use == 1
                later = pool.submit(completion, port, max_tokens=3)
                wait_for(lambda: loop.queue_length == 1, "the freed place did not take a new request")
            # the first client leaves too: the slot frees and the request that waited runs
            assert later.result(timeout=20).json()["choices"][0]["finish_reason"] == "length"
        values = scrape(port)
        assert outcome(values, "queue_full") == 1 and outcome(values, "cancelled") == 2
        assert outcome(values, "length") == 1
        assert values["archlab_queue_length"] == 0 and values["archlab_slots_in_use"] == 0


def test_the_time_limit_ends_a_request_with_its_text_so_far_and_frees_the_slot(tiny):
    """200 tokens at 20 ms a step would take 4 s; the limit of 0.5 s ends the request with the
    tokens it has, as finish_reason "length", plain or streaming."""
    model, tok, eos = tiny

    def alone(n: int) -> str:  # the first n tokens of the same request in a one-slot engine
        params = SamplingParams(max_new_tokens=n, temperature=0, stop_tokens=(eos,))
        return tok.decode([t for t in Engine(model, slots=1).generate([tok.encode("def f(").ids], params)[0].tokens
                           if t != eos])

    limits = ServerLimits(request_timeout=0.5)
    with running_server(slow_engine(model, 2, 0.02), tok, eos, limits=limits) as (loop, port):
        plain = completion(port, max_tokens=200).json()
        n = plain["usage"]["completion_tokens"]
        assert plain["choices"][0]["finish_reason"] == "length" and 0 < n < 200, plain
        assert plain["choices"][0]["text"] == alone(n)
        body = {"model": "tiny", "prompt": "def f(", "max_tokens": 200, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
        n = events[-1]["usage"]["completion_tokens"]
        assert 0 < n < 200 and "".join(e["choices"][0]["text"] for e in events if e["choices"]) == alone(n)
        wait_for(lambda: not loop.slots_in_use and not loop.scheduler.running,
                 "the timed-out request still holds its slot")
        assert outcome(scrape(port), "timeout") == 2


def test_a_plain_request_whose_client_leaves_frees_its_slot(tiny):
    """Not only streams: a client that gives up on a plain (non-streaming) request cancels it."""
    model, tok, eos = tiny
    with running_server(slow_engine(model, 2, 0.02), tok, eos) as (loop, port):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=0.5,
                       json={"model": "tiny", "prompt": "def f(", "max_tokens": 200, "temperature": 0})
        # within far less than the 200 steps (4 s) the request asked for
        wait_for(lambda: not loop.slots_in_use and not loop.scheduler.running,
                 "the abandoned request still holds its slot", seconds=2)
        values = scrape(port)
        assert outcome(values, "cancelled") == 1 and values["archlab_requests_in_progress"] == 0


def test_a_client_gone_before_its_body_arrived_is_counted_not_a_server_error(tiny):
    model, tok, eos = tiny
    with running_server(Engine(model, slots=2), tok, eos) as (loop, port):
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"model\": ")  # then hangs up mid-body
        wait_for(lambda: outcome(scrape(port), "cancelled") == 1, "the half-sent request was not counted")
        assert completion(port, max_tokens=2).status_code == 200
        assert scrape(port)["archlab_requests_in_progress"] == 0


# ---- /health and /metrics ---------------------------------------------------------------------------
def test_metrics_count_requests_tokens_and_latencies(tiny):
    model, tok, eos = tiny
    with running_server(Engine(model, slots=2), tok, eos) as (_, port):
        before = scrape(port)
        plain = completion(port, max_tokens=6).json()
        body = {"model": "tiny", "prompt": "import os\n", "max_tokens": 5, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            assert r.read().decode().endswith("data: [DONE]\n\n")
        assert completion(port, max_tokens=-1).status_code == 400
        after = scrape(port)

    def moved(name: str) -> float:
        return after[name] - before[name]

    prompt_tokens = plain["usage"]["prompt_tokens"] + len(tok.encode("import os\n").ids)
    assert moved('archlab_requests_total{outcome="length"}') == 2
    assert moved('archlab_requests_total{outcome="invalid"}') == 1
    assert moved("archlab_generated_tokens_total") == 11 and moved("archlab_prompt_tokens_total") == prompt_tokens
    assert moved("archlab_time_to_first_token_seconds_count") == 2
    assert moved("archlab_time_per_output_token_seconds_count") == 11 - 2  # between consecutive tokens
    assert moved("archlab_request_duration_seconds_count") == 2
    assert moved("archlab_time_to_first_token_seconds_sum") > 0
    assert after["archlab_slots"] == 2 and after["archlab_slots_in_use"] == 0 and after["archlab_queue_length"] == 0
    assert after["archlab_requests_in_progress"] == 0


def test_health_and_requests_report_a_failed_engine(tiny):
    """A decode step that raises: the plain and the streaming request in flight get the error
    (503, and an error event as the stream's last), /health turns 503, new requests are refused."""
    model, tok, eos = tiny
    engine, both_running = slow_engine(model, 2, 0.02), threading.Event()
    step = engine.step

    def breaking_step(greedy: bool = False, penalised: bool = False):
        if both_running.is_set():
            raise RuntimeError("simulated device failure")
        return step(greedy, penalised)

    engine.step = breaking_step
    body = {"model": "tiny", "prompt": "def f(", "max_tokens": 200, "temperature": 0, "stream": True}
    with running_server(engine, tok, eos) as (loop, port), ThreadPoolExecutor(1) as pool:
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        plain = pool.submit(completion, port, max_tokens=200)
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines)[6:])["choices"][0]["finish_reason"] is None
            wait_for(lambda: loop.slots_in_use == 2, "the two requests never ran together")
            both_running.set()
            last = [json.loads(line[6:]) for line in lines if line.startswith("data: ")][-1]
        assert "simulated device failure" in last["error"]["message"]
        failed = plain.result(timeout=20)
        assert failed.status_code == 503 and "simulated device failure" in failed.json()["error"]["message"]
        health = httpx.get(f"http://127.0.0.1:{port}/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        refused = completion(port, max_tokens=4)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"
        assert outcome(scrape(port), "error") == 3


def test_the_text_format_of_numbers_labels_and_histograms():
    assert [number(v) for v in (3, 2.5, 1e-6, math.inf, math.nan, 2.0)] == ["3", "2.5", "1e-06", "+Inf", "NaN", "2"]
    assert label_text({"a": 'say "hi"\\ \n'}) == '{a="say \\"hi\\"\\\\ \\n"}'
    h = Histogram("x_seconds", "test", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 7.0):
        h.observe(v)
    assert h.samples() == ['x_seconds_bucket{le="0.1"} 2', 'x_seconds_bucket{le="1"} 3',
                           'x_seconds_bucket{le="+Inf"} 4', "x_seconds_sum 7.65", "x_seconds_count 4"]
    c = Counter("y_total", "test", "outcome", ("a", "b"))
    c.inc(value="b")
    assert c.samples() == ['y_total{outcome="a"} 0', 'y_total{outcome="b"} 1']
    values = parse_exposition(ServerMetrics(4, lambda: 1, lambda: 3).render())
    assert values["archlab_queue_length"] == 1 and values["archlab_slots_in_use"] == 3


# ---- the listening socket ---------------------------------------------------------------------------
def test_a_port_in_use_is_one_line_and_no_serving_line(tiny_run, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_cli(capsys, "serve", "--ckpt", str(tiny_run), "--port", str(port), "--device", "cpu",
                                 "--no-warm-up")
    assert code == 1 and "serving" not in err + out, err
    assert err.strip() == f"archlab: cannot listen on 127.0.0.1:{port}: address already in use (another server " \
                          f"is there: stop it or choose another --port)"


def test_an_address_not_on_this_machine_is_one_line():
    with pytest.raises(ArchlabError, match="cannot listen on 192.0.2.1:0: cannot assign requested address") as e:
        bind("192.0.2.1", 0)  # TEST-NET-1: never a local address
    assert "\n" not in str(e.value)


def test_port_zero_binds_a_free_port():
    assert port_number("0") == 0
    with bind("127.0.0.1", 0) as sock:
        assert sock.getsockname()[1] > 0
