"""Every GPU kernel of one engine prefill and one decode step, in launch order, per model.

    python benchmarks/kernel_timeline.py --presets 124m,1b --models baseline,branch --json timeline.json

Where ``decode_latency.py`` only times the engine's captured graphs, this also says what they are
made of. One engine per model and batch size compiles its prefill (a ``--prompt`` token prompt)
and its decode step (caches holding ``--context`` tokens) as it serves; both are timed as the
engine replays them (CUDA-graph replays, medians of CUDA events; the decode step against its
bandwidth roofline), then the step bodies run uncaptured under torch.profiler, so every kernel is
seen (kernel durations are those of the graph; the gaps between kernels are not). For each it
prints the kernels per call and their summed GPU time, the time by kernel (names shortened), and
writes the ordered list, one entry per kernel with its start, duration and name, to ``--json``.
Comparing the baseline's list with the branch's shows where the branch's extra time goes; the
decode list shows how many kernels each layer costs. The engine's cache holds ``--prompt`` + 1
slots (``decode_latency.py`` sizes its decode engines to the context instead), so decode
times differ slightly between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from archlab.config import PRESETS  # noqa: E402
from archlab.infer.bench import _timer, copy_bandwidth, prompt_tokens  # noqa: E402
from archlab.infer.engine import Engine  # noqa: E402
from archlab.infer.sampling import SamplingParams  # noqa: E402
from archlab.model.accounting import decode_bytes_per_step  # noqa: E402
from decode_latency import models  # noqa: E402


def _short(name: str) -> str:
    """A kernel name without its template arguments and argument list."""
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"<.*", "", name)
    return name[:90]


def _kernels(fn, reps: int) -> list[dict]:
    """The kernels of the middle one of ``reps`` calls of ``fn``, in launch order. The calls are
    told apart by the idle time between them: each is followed by a synchronisation and 20 ms of
    sleep, far more than any host gap inside a call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
            time.sleep(0.02)
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    calls, cur, last_end = [], [], None
    for e in events:
        if last_end is not None and e.time_range.start - last_end > 10_000:
            calls.append(cur)
            cur = []
        cur.append(e)
        last_end = max(last_end or 0, e.time_range.end)
    if cur:
        calls.append(cur)
    if len(calls) != reps:
        print(f"  (found {len(calls)} calls in the profile, not {reps}: the list may mix calls)", flush=True)
    pick = calls[len(calls) // 2]
    t0 = pick[0].time_range.start
    return [{"start_us": round(e.time_range.start - t0, 2), "us": round(e.time_range.elapsed_us(), 2),
             "name": e.name[:200]} for e in pick]


def summary(label: str, kernels: list[dict], top: int) -> dict:
    busy = sum(k["us"] for k in kernels)
    by = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        s = by[_short(k["name"])]
        s[0] += k["us"]
        s[1] += 1
    print(f"\n{label}: {len(kernels)} kernels, GPU busy {busy / 1e3:.3f} ms")
    for name, (us, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {us:9.1f} us  x{n:4d}  {name}")
    return {"kernels": len(kernels), "busy_us": busy, "by_name": {k: v for k, v in by.items()}}


def profile_model(model, label: str, args, batch: int, max_len: int, bandwidth: float, out: dict) -> None:
    """One engine of ``batch`` slots: the prefill of a ``--prompt`` token prompt per slot, then
    decode steps whose caches hold ``--context`` tokens (the first ``--context`` slots the
    prefill wrote), so one prefill shape and one decode step are compiled. Each is timed as the
    engine runs it (captured graphs, medians of CUDA events, as ``archlab bench``), then profiled
    uncaptured."""
    vocab, n = model.cfg.vocab_size, batch
    timer = _timer(torch.device("cuda"))
    eng = Engine(model, slots=n, max_len=max_len)
    prompts = [prompt_tokens(args.prompt, vocab, seed=i) for i in range(n)]
    rows, params = list(range(n)), [SamplingParams(max_new_tokens=1, temperature=0)] * n
    eng.prefill(rows, prompts, params)  # compiles and captures
    if not args.no_prefill:
        key = f"{label} prefill {args.prompt} x{n}"
        ms = timer(lambda: eng.prefill(rows, prompts, params), 10, 3)
        print(f"{key}: {ms:.3f} ms (time to first token)", flush=True)
        ks = _kernels(next(iter(eng._prefills.values()))._body, 3)
        out[key] = {"ms": ms, "summary": summary(key, ks, args.top), "kernels": ks}
    if not args.no_decode:
        key = f"{label} decode ctx {args.context} x{n}"
        eng.positions.fill_(args.context)
        eng.step(True)  # compiles and captures
        eng.positions.fill_(args.context)
        ms = timer(lambda: eng.step(True), 100, 8)
        roof = decode_bytes_per_step(model.cfg, args.context, n, model.lm_head.weight.element_size()) / bandwidth * 1e3
        print(f"{key}: {ms:.3f} ms per step, roofline {roof:.3f} ms ({roof / ms:.1%})", flush=True)
        eng.positions.fill_(args.context)
        ks = _kernels(lambda: eng._step_body(True, False), 5)
        out[key] = {"ms": ms, "roofline_ms": roof, "summary": summary(key, ks, args.top), "kernels": ks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="124m")
    ap.add_argument("--models", default="baseline,branch")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1", help="slots of each engine, e.g. 1,8")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--set", action="append", default=[], dest="extra", help="config override for every model")
    ap.add_argument("--json")
    args = ap.parse_args()
    names = args.models.split(",")
    if not set(names) <= {"baseline", "branch"}:
        ap.error(f"--models: baseline and/or branch, got {args.models!r}")
    presets = args.presets.split(",")
    if not set(presets) <= set(PRESETS):
        ap.error(f"--presets: each of {', '.join(PRESETS)}; got {args.presets!r}")
    try:
        batches = [int(x) for x in args.batches.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        ap.error(f"--batches: comma-separated positive integers, got {args.batches!r}")
    if args.prompt < 1 or args.context < 1 or args.top < 1:
        ap.error("--prompt, --context and --top must be positive")
    if not torch.cuda.is_available():
        print("kernel_timeline: no CUDA device; nothing to profile")
        return
    bw = copy_bandwidth(torch.device("cuda"))
    out = {"copy_TBps": bw / 1e12, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps(out), flush=True)
    with torch.no_grad():
        for preset in presets:
            max_len = max(args.prompt + 1, args.context + 64)
            base, branch = models(preset, max_len, args.extra)
            for batch, name in [(b, m) for b in batches for m in names]:
                model = base if name == "baseline" else branch
                try:
                    profile_model(model, f"{preset} {name}", args, batch, max_len, bw, out)
                except Exception as e:  # one model's failure leaves the others' rows
                    print(f"{preset} {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(out, f, indent=1)
                torch.cuda.empty_cache()
            del base, branch
    os._exit(0)


if __name__ == "__main__":
    main()
