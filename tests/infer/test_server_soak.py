"""Soak test: ``archlab serve --slots 4`` as its own process on loopback, under mixed streaming
and plain requests from concurrent clients that disconnect at random, for a bounded time.

    ARCHLAB_SOAK_SECONDS=120 .venv/bin/python -m pytest -q -s tests/infer/test_server_soak.py   # the full soak

CI runs it for ``ARCHLAB_SOAK_SECONDS`` = 15 (the default); ``-s`` shows its one-line summary.
Checked:

* no request lost or mixed with another: every request a client did not abandon gets a complete
  answer whose text is what its prompt gives alone in a one-slot engine (greedy, or sampled with
  its seed), and the text an abandoned stream received is a prefix of that;
* the server's accounts agree: nothing in progress, queued or in a slot at the end, no errors, no
  time-outs, disconnects counted as cancellations;
* the server's resident memory is flat after warm-up: its highest sample in the last quarter of
  the run is at most ``RSS_TOLERANCE`` above its median in the second quarter;
* the server still answers, and Ctrl-C (SIGINT) stops it with one line and exit code 130.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil  # the test extra's: a soak that skipped itself would look like a soak that passed
import pytest

from archlab.infer.engine import Engine
from archlab.infer.loading import load_for_inference
from archlab.infer.sampling import SamplingParams
from tests.infer.test_server_network import outcome, parse_exposition

SOAK_SECONDS = float(os.environ.get("ARCHLAB_SOAK_SECONDS", "15"))
CLIENTS = 10  # more than the 4 slots: requests wait in the queue as well
RSS_TOLERANCE = 16 << 20  # bytes; measured: 0.5 MiB over a 120 s soak, at about 440 MiB
KEY = "soak-key"
PROMPTS = ("def f(", "import os\n", "class A:", "x = ", "# comment", "return", "while True:", "def main():\n")
LENGTHS = (8, 16, 24)
DROP_LENGTH = 48  # requests that will be abandoned run long enough to be running when they are
SAMPLINGS = ((0.0, 0), (0.9, 1))  # (temperature, seed): greedy, and sampled with a seed


def expected_texts(tiny_run) -> dict[tuple[str, int, float, int], str]:
    """What each (prompt, max_tokens, temperature, seed) gives alone, in a one-slot engine. A
    shorter max_tokens gives the first tokens of the longest run (the sampler is keyed by seed
    and position), so one run per prompt and sampling serves every length."""
    model, tok, eos, _ = load_for_inference(tiny_run, "cpu", "float32")
    engine = Engine(model, slots=1)
    texts = {}
    for prompt in PROMPTS:
        for temperature, seed in SAMPLINGS:
            params = SamplingParams(max_new_tokens=DROP_LENGTH, temperature=temperature, top_p=0.95, seed=seed,
                                    stop_tokens=(eos,))
            tokens = engine.generate([tok.encode(prompt).ids], params)[0].tokens
            for n in (*LENGTHS, DROP_LENGTH):
                texts[prompt, n, temperature, seed] = tok.decode([t for t in tokens[:n] if t != eos])
    return texts


def start_server(tiny_run, log: Path) -> tuple[subprocess.Popen, str]:
    """``archlab serve`` on a free loopback port: (the process, its base URL) once it serves."""
    env = {**os.environ, "ARCHLAB_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "archlab.cli", "serve", "--ckpt", str(tiny_run), "--port", "0",
                             "--slots", "4", "--device", "cpu", "--model-name", "tiny"],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env,
                            # a runner started in the background ignores SIGINT, and children inherit that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while True:
        found = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start: {log.read_text()}")
        time.sleep(0.1)


class Tally:
    def __init__(self):
        self.sent = self.completed = self.dropped = self.reached = self.tokens = 0
        self.failures: list[str] = []


async def one_client(index: int, base: str, stop_at: float, texts, tally: Tally) -> None:
    rng = random.Random(index)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as http:
        while time.monotonic() < stop_at:
            mode = rng.choices(("plain", "stream", "stream_drop", "plain_drop"), (35, 35, 15, 15))[0]
            prompt, (temperature, seed) = rng.choice(PROMPTS), rng.choice(SAMPLINGS)
            n = DROP_LENGTH if mode.endswith("drop") else rng.choice(LENGTHS)
            want = texts[prompt, n, temperature, seed]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": temperature, "top_p": 0.95,
                    "seed": seed, "stream": mode.startswith("stream")}
            what = f"{mode} {body}"
            tally.sent += 1
            try:
                if mode == "plain":
                    r = await http.post("/v1/completions", json=body)
                    got = r.json()
                    if r.status_code != 200 or got["choices"][0]["text"] != want:
                        tally.failures.append(f"{what}: {r.status_code} {got} != {want!r}")
                    tally.completed += 1
                    tally.tokens += got["usage"]["completion_tokens"]
                elif mode == "plain_drop":  # gives up while the server still generates
                    try:
                        r = await asyncio.wait_for(http.post("/v1/completions", json=body), rng.uniform(0.02, 0.15))
                    except TimeoutError:
                        tally.dropped += 1
                    else:  # it finished first
                        tally.completed += 1
                        if r.json()["choices"][0]["text"] != want:
                            tally.failures.append(f"{what}: {r.json()} != {want!r}")
                else:
                    keep = rng.randint(1, 3) if mode == "stream_drop" else None
                    parts, finished = [], False
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line == "data: [DONE]":
                                finished = True
                            elif line.startswith("data: "):
                                parts.append(json.loads(line[6:])["choices"][0]["text"])
                                if keep is not None and len(parts) >= keep:
                                    break  # leaving the block closes the connection mid-stream
                    text = "".join(parts)
                    if finished:
                        tally.completed += 1
                        if text != want:
                            tally.failures.append(f"{what}: {text!r} != {want!r}")
                    else:
                        tally.dropped += 1
                        tally.reached += bool(parts)  # the server surely saw this one
                        if keep is None or not want.startswith(text):
                            tally.failures.append(f"{what}: ended early with {text!r} (whole: {want!r})")
            except (httpx.HTTPError, KeyError, ValueError) as e:
                tally.failures.append(f"{what}: {type(e).__name__}: {e}")


async def sample_rss(pid: int, stop_at: float, samples: list[tuple[float, int]]) -> None:
    process, t0 = psutil.Process(pid), time.monotonic()
    while time.monotonic() < stop_at:
        samples.append((time.monotonic() - t0, process.memory_info().rss))
        await asyncio.sleep(0.25)


async def soak(base: str, pid: int, texts, tally: Tally, rss: list[tuple[float, int]]) -> None:
    stop_at = time.monotonic() + SOAK_SECONDS
    await asyncio.gather(sample_rss(pid, stop_at, rss),
                         *(one_client(i, base, stop_at, texts, tally) for i in range(CLIENTS)))


def test_soak_mixed_requests_with_disconnects(tiny_run, tmp_path):
    texts = expected_texts(tiny_run)
    whole = [texts[p, max(LENGTHS), 0.0, 0] for p in PROMPTS]
    assert len(set(whole)) == len(whole)  # each prompt's greedy text differs: a mix-up would show
    log = tmp_path / "serve.log"
    proc, base = start_server(tiny_run, log)
    try:
        tally, rss = Tally(), []
        asyncio.run(soak(base, proc.pid, texts, tally, rss))
        assert not tally.failures, f"{len(tally.failures)} of {tally.sent} requests went wrong: {tally.failures[:5]}"
        assert tally.completed > 10 * CLIENTS and tally.dropped > CLIENTS, vars(tally)
        # the last in-flight requests end (each abandoned one is noticed within a step or two)
        auth = {"Authorization": f"Bearer {KEY}"}
        deadline = time.time() + 15
        while True:
            values = parse_exposition(httpx.get(f"{base}/metrics", headers=auth).text)
            idle = [values[k] for k in ("archlab_requests_in_progress", "archlab_queue_length",
                                        "archlab_slots_in_use")]
            if idle == [0, 0, 0]:
                break
            assert time.time() < deadline, f"the server did not drain: in progress, queued, in slots: {idle}"
            time.sleep(0.1)
        finished = outcome(values, "stop") + outcome(values, "length")
        cancelled = outcome(values, "cancelled")
        assert finished >= tally.completed and cancelled >= 1, (finished, cancelled, vars(tally))
        assert tally.completed + tally.reached <= finished + cancelled <= tally.sent, (finished, cancelled,
                                                                                        vars(tally))
        for bad in ("timeout", "error", "invalid", "unauthorized", "too_large", "queue_full"):
            assert outcome(values, bad) == 0, (bad, values)
        assert values["archlab_generated_tokens_total"] >= tally.tokens
        warm = [m for t, m in rss if SOAK_SECONDS / 4 <= t < SOAK_SECONDS / 2]
        late = [m for t, m in rss if t >= SOAK_SECONDS * 3 / 4]
        growth = max(late) - statistics.median(warm)
        summary = (f"soak of {SOAK_SECONDS:g} s: {tally.sent} requests ({tally.completed} answered, {tally.dropped} "
                   f"abandoned), server RSS {statistics.median(warm) / 2 ** 20:.1f} MiB after warm-up, at most "
                   f"{max(late) / 2 ** 20:.1f} MiB in the last quarter")
        print(summary)  # shown with -s
        assert growth <= RSS_TOLERANCE, summary
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}
        proc.send_signal(signal.SIGINT)  # Ctrl-C: one line, the shell's code for an interrupt
        assert proc.wait(timeout=20) == 130
        assert log.read_text().splitlines()[-1] == "archlab: interrupted; the server has stopped", log.read_text()
        assert "Traceback" not in log.read_text(), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
