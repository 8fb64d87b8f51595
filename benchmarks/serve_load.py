"""Load on ``archlab serve``: N concurrent streaming clients against one client, on one GPU.

    python benchmarks/serve_load.py --tokenizer DATA_DIR/tokenizer.json --preset 124m --clients 64
    python benchmarks/serve_load.py --device cpu --preset tiny --clients 32   # CPU, a byte tokenizer

Serves a randomly initialised preset model (bf16) with the prepared corpus's tokenizer through the
real server (``archlab.infer.server``: FastAPI + uvicorn, the engine thread, continuous batching),
then streams completions over HTTP (httpx, server-sent events) from 1 and from N concurrent
clients. Reports completed streams (none may be lost), tokens received, aggregate tokens/s, and
per-stream time to first token, and how the engine batched them: decode steps, the mean and the
most active slots per step (1 means the streams ran one after another), prefill calls and the
requests they admitted, and ``steady_ms_per_step``: the median time between decode steps over the
middle half of a load, without the streams' admission and ends. ``--stream-interval N`` sends an
event every N tokens after the first.

``--null-model`` makes every decode step free (the same token each time, one that is text on its
own): what is left is the host path's own rate (scheduling, detokenising, server-sent events, the
event loop), the ceiling the server can reach on any model. With it, ``--device-step-ms`` gives the
steps a simulated device that runs them one after another while the host goes on, as a GPU does
(launch returns at once, reading the tokens waits for the step's end), and ``--device-prefill-ms``
makes each prefill call take that long instead of running the model: the host path against a GPU's
timings, on any machine's CPU. ``--step-delay`` instead adds seconds to every decode step on the
host (a GIL-free sleep that the host cannot overlap). Prints one JSON object per load level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from archlab.config import make_config  # noqa: E402
from archlab.data.tokenizer import EOS_TOKEN, load_tokenizer  # noqa: E402
from archlab.infer import engine as engine_module  # noqa: E402
from archlab.infer.engine import Engine  # noqa: E402
from archlab.infer import streams  # noqa: E402
from archlab.infer.server import EngineLoop, create_app  # noqa: E402
from archlab.model import build_model  # noqa: E402


async def one_stream(client, url: str, prompt: str, max_tokens: int, seed: int) -> dict:
    t0 = time.perf_counter()
    first, tokens, finish, events = None, 0, None, 0
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None:
                first = time.perf_counter() - t0
            if chunk["choices"]:
                finish = chunk["choices"][0]["finish_reason"] or finish
                events += 1
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    # perf_counter is the system's monotonic clock on Linux: the server's process reads the same one
    return {"ttft_s": first, "tokens": tokens, "finish": finish, "events": events,
            "wall_s": time.perf_counter() - t0, "started_at": t0, "first_at": t0 + (first or 0.0),
            "ended_at": time.perf_counter()}


def clean_token(tok) -> int:
    """The id of a token that decodes to plain text by itself and repeated (``" a"`` or ``"a"``)."""
    for text in (" a", "a", " the", "e"):
        ids = tok.encode(text).ids
        if len(ids) == 1 and tok.decode(ids * 3) == text * 3:
            return ids[0]
    raise SystemExit("--null-model: no token in this vocabulary decodes to plain text alone")


class ByteTokenizer:
    """A stand-in for a trained tokenizer (``--preset tiny`` without ``--tokenizer``): bytes."""

    class _Ids:
        def __init__(self, ids: list[int]):
            self.ids = ids

    def encode(self, text: str) -> "ByteTokenizer._Ids":
        return self._Ids(list(text.encode()))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return 256

    def token_to_id(self, token: str) -> int | None:
        return None


async def load(url: str, clients: int, max_tokens: int, first: int = 0, go=None, ready=None) -> dict:
    """``clients`` concurrent streams (seeds and prompts ``first`` on); with ``go`` (an event of
    another process), the client is made first, said ``ready``, and the streams start when
    ``go`` is set."""
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        if go is not None:
            ready.put(True)
            await asyncio.to_thread(go.wait)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, f"Once upon a time {i}", max_tokens, i)
                                         for i in range(first, first + clients)), return_exceptions=True)
    ok = [r for r in results if isinstance(r, dict) and r["finish"] in ("length", "stop")]
    return {"clients": clients, "errors": [repr(r) for r in results if not isinstance(r, dict)][:3],
            "load_started_at": t0, "streams": ok}


def summarise(parts: list[dict]) -> dict:
    """One load's figures from its client processes' parts (their clocks are the same one): the
    wall time from the first stream's start to the last one's end."""
    ok = [st for part in parts for st in part["streams"]]
    clients = sum(part["clients"] for part in parts)
    t0 = min(part["load_started_at"] for part in parts)
    wall = max((st["ended_at"] for st in ok), default=time.perf_counter()) - t0
    return {"clients": clients, "completed": len(ok), "lost": clients - len(ok),
            "errors": [e for part in parts for e in part["errors"]][:3],
            "tokens": sum(r["tokens"] for r in ok), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_median_s": statistics.median(r["ttft_s"] for r in ok) if ok else None,
            "events_median": statistics.median(r["events"] for r in ok) if ok else None,
            "load_started_at": t0, "streams": ok}


def _clients_process(url: str, clients: int, max_tokens: int, first: int, go, ready, out) -> None:
    out.put(asyncio.run(load(url, clients, max_tokens, first, go, ready)))


def run_clients(url: str, clients: int, max_tokens: int, in_process: bool, procs: int = 1) -> dict:
    """The load, from ``procs`` processes of their own by default (64 httpx streams parsing
    server-sent events in the server's process would hold its GIL and be measured as the
    server's cost; one client process parsing them all can fall behind the server and be
    measured as its cost too). Each process makes its client, then all start together."""
    if in_process:
        return summarise([asyncio.run(load(url, clients, max_tokens))])
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = max(1, min(procs, clients))
    sizes = [clients // procs + (i < clients % procs) for i in range(procs)]
    starts = [sum(sizes[:i]) for i in range(procs)]
    workers = [ctx.Process(target=_clients_process, args=(url, n, max_tokens, first, go, ready, out), daemon=True)
               for n, first in zip(sizes, starts)]
    for w in workers:
        w.start()
    for _ in workers:  # each has imported httpx and made its client
        ready.get()
    go.set()
    parts = [out.get() for _ in workers]
    for w in workers:
        w.join()
    return summarise(parts)


def engine_rate(engine: Engine, steps: int = 200) -> dict:
    """Milliseconds per decode step and tokens/s of ``engine`` stepping every slot on its own."""
    def sync() -> None:
        if engine.cuda:
            torch.cuda.synchronize()

    for _ in range(5):
        engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    return {"slots": engine.slots, "ms_per_step": round(1e3 * dt, 4), "tokens_per_s": round(engine.slots / dt)}


def record_calls(obj, name: str, entry=lambda *args_, **kwargs: time.perf_counter()) -> list:
    """``entry(*args)`` of every call of ``obj.name`` (by default the host time it starts),
    appended as they come; an entry of None is not kept. ``obj`` may be a class, whose method
    then gets ``self`` first."""
    entries: list = []
    fn = getattr(obj, name)

    def recorded(*args_, **kwargs):
        value = entry(*args_, **kwargs)
        if value is not None:
            entries.append(value)
        return fn(*args_, **kwargs)

    setattr(obj, name, recorded)
    return entries


def timeline(load: dict, requests: list, steps: list[float], ends: list[float]) -> dict[str, float]:
    """Where a load's wall time goes, in ms from its start (the clients' process starts its
    streams then) to the median (p50) and last (max) stream: the requests reaching the engine
    (parsed, tokenised and submitted), the engine's first token for each (``admit_ms``: from its
    submission), the first token at the client, the first and last decode step, and the streams'
    ends in the server and at the clients; ``tail_ms`` is how long the last stream ended at its
    client after the last step, ``client_lag_ms`` how much of that the clients added after the
    server's end (a load generator that falls behind)."""
    t0, streams = load["load_started_at"], load["streams"]
    if not streams or not requests or not steps:
        return {}

    def p50_max(values: list[float], name: str) -> dict[str, float]:
        return {f"{name}_p50_ms": round(1e3 * statistics.median(values), 1), f"{name}_max_ms": round(1e3 * max(values), 1)}

    out = {**p50_max([r.submitted - t0 for r in requests], "submitted"),
           **p50_max([r.first_token_at - r.submitted for r in requests if r.first_token_at], "admit"),
           **p50_max([s["first_at"] - t0 for s in streams], "client_first"),
           "first_step_ms": round(1e3 * (steps[0] - t0), 1), "last_step_ms": round(1e3 * (steps[-1] - t0), 1),
           **p50_max([e - t0 for e in ends] or [float("nan")], "server_ended"),
           **p50_max([s["ended_at"] - t0 for s in streams], "ended")}
    out["tail_ms"] = round(out["ended_max_ms"] - out["last_step_ms"], 1)
    out["client_lag_ms"] = round(out["ended_max_ms"] - out["server_ended_max_ms"], 1)
    return out


def steady_interval(times: list[float]) -> float:
    """The median time between two steps over the middle half of a load's decode steps:
    the steady state, without the admission of the streams at the start and their ends."""
    n = len(times)
    gaps = [b - a for a, b in zip(times[n // 4:3 * n // 4], times[n // 4 + 1:3 * n // 4 + 1])]
    return statistics.median(gaps) if gaps else float("nan")


def interval_spread(times: list[float]) -> dict[str, float]:
    """How the gaps between steps spread over the whole load (ms): the mean beside the median
    (a median hides stalls), the 99th percentile, and the share of the load's time spent in
    gaps longer than twice the steady interval."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    if len(gaps) < 2:
        return {}
    steady = steady_interval(times)
    long = sum(g for g in gaps if g > 2 * steady)
    return {"mean_gap_ms": round(1e3 * statistics.fmean(gaps), 3),
            "p99_gap_ms": round(1e3 * statistics.quantiles(gaps, n=100)[98], 3),
            "long_gap_share": round(long / sum(gaps), 3)}


class SimulatedStep:
    """A launched step on the simulated device: its tokens can be read once its time is up."""

    def __init__(self, tokens: list[int], done_at: float):
        self.tokens, self.done_at = tokens, done_at

    def wait(self) -> list[int]:
        left = self.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)  # releases the GIL, as waiting on a CUDA event does
        return self.tokens


def simulate_device(engine: Engine, step_s: float) -> None:
    """Give ``engine``'s (null) decode steps a device that takes ``step_s`` per step and runs
    them in order, one after another, while the host goes on: a step launched while another runs
    starts when that one ends. ``step_async`` returns at once, as a CUDA graph's launch does; a
    synchronous ``step`` waits for its own end. What ``--step-delay`` cannot show: how much of the
    host's work per step the device's time hides."""
    state = {"free_at": 0.0}
    step = engine.step

    def launch() -> float:
        state["free_at"] = max(time.perf_counter(), state["free_at"]) + step_s
        return state["free_at"]

    def step_async(*args_, **kwargs):
        tokens = step(*args_, **kwargs).tolist()
        return SimulatedStep(tokens, launch())

    def step_sync(*args_, **kwargs):
        tokens = step(*args_, **kwargs)
        SimulatedStep([], launch()).wait()
        return tokens

    engine.step_async = step_async  # type: ignore[method-assign]
    engine.step = step_sync  # type: ignore[method-assign]


def simulate_prefill(engine: Engine, token: int, call_s: float) -> None:
    """Prefill calls that set the slots' state as the engine's do (sampling parameters, first
    token, positions) and take ``call_s`` each instead of running the model; a batch is still
    split into the engine's groups (``engine._group_plan``), one call per group."""
    def prefill_group(rows: list[int], prompts: list[list[int]], params, real: int):
        index = torch.tensor(rows[:real], device=engine.device)
        engine._set_params(index, params[:real])
        first = torch.full((len(rows),), token, dtype=torch.long, device=engine.device)
        engine.tokens[index] = first[:real]
        engine.positions[index] = torch.tensor([len(p) for p in prompts[:real]], device=engine.device)
        time.sleep(call_s)
        return first, torch.zeros(len(rows), engine.vocab, device=engine.device)

    engine._prefill_group = prefill_group  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="a tokenizer.json (default with --preset tiny: bytes)")
    ap.add_argument("--preset", default="124m", help="a config preset, or tiny (the tests' tiny model)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per decode step")
    ap.add_argument("--device-step-ms", type=float, default=0.0,
                    help="with --null-model: each decode step takes this long on a simulated device that runs "
                         "while the host goes on (as a GPU's does), so host and device overlap as on a GPU")
    ap.add_argument("--device-prefill-ms", type=float, default=None,
                    help="with --null-model: each prefill call takes this long (the slots' state set, no model)")
    ap.add_argument("--null-model", action="store_true",
                    help="decode steps that cost nothing (the same token every step): the host path's own rate")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--clients-in-process", action="store_true",
                    help="run the HTTP clients in the server's process (sharing its GIL, as before the seventh "
                         "session) instead of in a process of their own")
    ap.add_argument("--no-pipeline", action="store_true",
                    help="hand out each step's tokens before launching the next (the engine loop's overlap off)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="tokens per streamed event after the first (archlab serve --stream-interval)")
    ap.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                    help="uvicorn's event loop (auto: uvloop when installed, as archlab serve)")
    ap.add_argument("--http", default="auto", choices=("auto", "h11", "httptools"),
                    help="uvicorn's HTTP parser (auto: httptools when installed, as archlab serve)")
    ap.add_argument("--no-pad-groups", action="store_true",
                    help="admit a burst as groups of powers of eight without padding (the engine before the "
                         "twenty-eighth session: 35 requests as 4 x 8 + 3 x 1 prefill calls, not one of 64)")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="processes the N clients' streams are spread over (default 1)")
    ap.add_argument("--repeats", type=int, default=1, help="run the N-client load this many times")
    ap.add_argument("--compare-pad", action="store_true",
                    help="each repeat runs the N-client load twice, padded and unpadded admission in turn")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.client_procs < 1:
        ap.error(f"--client-procs must be at least 1, got {args.client_procs}")
    if (args.device_step_ms or args.device_prefill_ms is not None) and not args.null_model:
        ap.error("--device-step-ms and --device-prefill-ms simulate the device of --null-model; add --null-model")
    import uvicorn

    if args.tokenizer is None and args.preset != "tiny":
        ap.error("--tokenizer is required with a preset other than tiny")
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else ByteTokenizer()
    torch.manual_seed(0)
    if args.preset == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.helpers import tiny_model_cfg

        cfg = tiny_model_cfg(vocab_size=tok.get_vocab_size(), max_seq_len=max(64, 2 * args.max_tokens))
    else:
        cfg = make_config(args.preset, overrides=[f"model.vocab_size={tok.get_vocab_size()}"]).model
    # the longest prompt the clients send ("Once upon a time N"), in this tokenizer's tokens
    longest_prompt = len(tok.encode(f"Once upon a time {args.clients - 1}").ids)
    if longest_prompt + args.max_tokens > cfg.max_seq_len:
        ap.error(f"--max-tokens {args.max_tokens}: the prompts' {longest_prompt} tokens and the completion do "
                 f"not fit the model's context of {cfg.max_seq_len}; at most {cfg.max_seq_len - longest_prompt}")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(cfg).to(args.device, dtype).eval()
    engine = Engine(model, slots=args.clients)
    t = time.perf_counter()
    engine.warm_up(buckets=(16,), batch_sizes=engine.group_sizes())
    print(json.dumps({"warm_up_s": time.perf_counter() - t}), flush=True)
    # The engine's own rate at every slot, in this process, before any request (as `archlab
    # bench decode --batches SLOTS` times it: sampled steps, tokens read back): the server's
    # aggregate is quoted against it.
    # With --null-model, the simulated device's rate (if any) stands in.
    if not args.null_model:
        alone = engine_rate(engine)
    elif args.device_step_ms:
        alone = {"slots": engine.slots, "ms_per_step": args.device_step_ms,
                 "tokens_per_s": round(engine.slots / (args.device_step_ms / 1e3))}
    else:
        alone = None
    print(json.dumps({"engine_alone": alone}), flush=True)
    if args.null_model:
        # The host path alone: every decode step returns the same token at no model cost, so the
        # rate is what scheduling, detokenising and the server-sent events allow.
        # A token that is text on its own: id 97 is "a" only for the byte tokenizer; in a BPE
        # vocabulary it may be a lone byte that decodes to U+FFFD, which streams quite differently.
        token = clean_token(tok)
        fixed = torch.full((engine.slots,), token, dtype=torch.long, device=engine.device)

        def null_step(*args_, **kwargs):
            engine.positions.add_(1).clamp_(max=engine.max_len - 1)
            engine.tokens.copy_(fixed)
            return engine.tokens

        engine.step = null_step  # type: ignore[method-assign]
    if args.device_step_ms:
        simulate_device(engine, args.device_step_ms / 1e3)
    if args.device_prefill_ms is not None:
        simulate_prefill(engine, token, args.device_prefill_ms / 1e3)
    if args.step_delay:
        step = engine.step

        def slow_step(*args_, **kwargs):  # the engine's step, whatever it takes, a little later
            time.sleep(args.step_delay)
            return step(*args_, **kwargs)

        engine.step = slow_step  # type: ignore[method-assign]
    loop = EngineLoop(engine, pipelined=not args.no_pipeline)
    # the decode steps (as the scheduler counts them, their tokens handed out), the requests
    # submitted (each keeps the host times of its submission and of its first token), and the
    # server's ends of its streams (``Choice.end``: the last piece made, its event written next)
    launches = record_calls(loop.scheduler, "_count_step")
    requests = record_calls(loop, "submit", lambda request, *args_, **kwargs: request)
    ends = record_calls(streams.Choice, "end", lambda choice, outcome: None if choice.ending else time.perf_counter())
    loop.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(loop, tok, "bench", tok.token_to_id(EOS_TOKEN),
                                                      stream_interval=args.stream_interval),
                                           host="127.0.0.1", port=port, log_level="warning",
                                           loop=args.loop, http=args.http))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/completions"
    rows = []
    calls = record_calls(engine, "_prefill_group")
    # The 1-client load, then the N-client one (``--repeats`` times; with ``--compare-pad`` the
    # padded and unpadded admissions in turn, in this one server (the same process and warm-up),
    # ordered ABBA ABBA ... so that neither always runs first)
    loads = [(1, True)] + [(args.clients, not args.compare_pad or i % 4 in (0, 3))
                           for i in range(args.repeats * (2 if args.compare_pad else 1))]
    for clients, pad in loads:
        engine_module.PAD_PREFILL_GROUPS = pad and not args.no_pad_groups
        loop.scheduler.reset_stats()
        launches.clear()
        requests.clear()
        ends.clear()
        calls.clear()
        r = run_clients(url, clients, args.max_tokens, args.clients_in_process, args.client_procs)
        r["client_procs"] = 1 if args.clients_in_process else min(args.client_procs, clients)
        r["pad_groups"] = engine_module.PAD_PREFILL_GROUPS
        r["prefill_calls"] = len(calls)
        r.update(timeline(r, requests, launches, ends))
        del r["streams"], r["load_started_at"]
        r["steady_ms_per_step"] = round(1e3 * steady_interval(launches), 3)
        r.update(interval_spread(launches))
        if alone is not None:
            r["of_engine_alone"] = round(r["tokens_per_s"] / alone["tokens_per_s"], 4)
        sc = loop.scheduler
        r.update(decode_steps=sc.decode_steps, mean_active_slots=round(sc.mean_active, 2),
                 wall_ms_per_step=round(1e3 * r["wall_s"] / max(1, sc.decode_steps), 3),
                 engine_ms_per_step=round(sc.mean_step_ms, 3),
                 emit_ms_per_step=round(1e3 * sc.emit_s / max(1, sc.decode_steps), 3),
                 max_active_slots=sc.max_active, prefills=sc.prefills, admitted=sc.admitted,
                 max_admit_wait_s=round(sc.max_admit_wait, 4), max_prefill_s=round(sc.max_prefill_s, 4))
        rows.append(r)
        print(json.dumps(r), flush=True)
    failed = [r for r in rows if not r["completed"]]
    if failed:
        print(f"error: no request of the {failed[0]['clients']}-client load completed "
              f"(first error: {failed[0]['errors'][0] if failed[0]['errors'] else 'none recorded'})", file=sys.stderr)
        server.should_exit = True
        loop.stop()
        os._exit(1)
    for r in rows[1:]:
        print(f"aggregate: {r['tokens_per_s']:.0f} tokens/s with {args.clients} clients vs "
              f"{rows[0]['tokens_per_s']:.0f} with one ({r['tokens_per_s'] / rows[0]['tokens_per_s']:.1f}x); "
              f"lost {r['lost']}; {r['mean_active_slots']:.1f} active slots per decode step on average "
              f"(most {r['max_active_slots']} of {args.clients}); median TTFT {1e3 * (r['ttft_median_s'] or 0):.0f} ms; "
              f"{r['prefill_calls']} prefill calls ({'padded' if r['pad_groups'] else 'unpadded'} groups)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    server.should_exit = True
    loop.stop()
    os._exit(0)


if __name__ == "__main__":
    main()
