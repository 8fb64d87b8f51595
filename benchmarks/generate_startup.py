"""`archlab generate` as a user runs it: the wall time of fresh processes, cold and warm, for each
``--compile`` choice, and the decode rate each prints against `archlab bench decode --batches 1`.

    PYTHONPATH=src python benchmarks/generate_startup.py --ckpt RUN [--tokens 64,256]
        [--compile off,on,auto] [--repeats 2] [--device cuda] [--json FILE]

For each ``--compile`` choice and each count of new tokens, the script starts ``archlab generate``
as a new process (greedy, one prompt), first with empty inductor, Triton and archlab (bytecode,
``archlab.bytecode``) caches of its own (``cold``: a machine that never ran it) and then
``--repeats`` times more with those caches kept (``warm``:
compiled artefacts from an earlier run exist). It records the process's wall time and parses the
line `generate` prints (load time, first token, and the decode rate timed after the first decode
hand-over). Then `archlab bench decode --batches 1` on the same checkpoint gives the engine's own
batch-1 rate (compiled, a CUDA graph), and every row states its decode rate as a fraction of it.
The greedy tokens of every process are compared with the first one's (they must be identical:
``--compile`` changes speed, not tokens).

Prints a Markdown table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

# The line `generate` prints (archlab.infer.cli.GenerationClock.report); the row keeps it whole.
REPORT = re.compile(r"(?P<n>\d+) tokens in (?P<wall>[\d.]+) s after loading in (?P<load>[\d.]+) s.*?"
                    r"first token after (?P<ttft>[\d,]+) ms(?: \([^)]*\))?"
                    r"(?:, then (?P<timed>\d+) tokens at (?P<rate>[\d,.]+) tokens/s.*?\((?P<setup>[\d.]+) s)?")


def archlab(*args: str, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    """One fresh ``python -m archlab.cli ARGS`` process: (wall seconds, its result)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "archlab.cli", *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"archlab {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return wall, done


def parse_report(stderr: str) -> dict:
    m = REPORT.search(stderr)
    if m is None:
        raise SystemExit(f"no generate report in:\n{stderr[-2000:]}")
    num = lambda k: None if m.group(k) is None else float(m.group(k).replace(",", ""))  # noqa: E731
    return {"report": m.group(0), "tokens": int(m.group("n")), "generate_s": num("wall"), "load_s": num("load"), "ttft_ms": num("ttft"),
            "decode_tokens_timed": num("timed"), "decode_tokens_per_s": num("rate"), "setup_s": num("setup")}


def bench_rate(ckpt: str, device: str, env: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        archlab("bench", "decode", "--ckpt", ckpt, "--device", device, "--batches", "1", "--json", str(out), env=env)
        return json.loads(out.read_text())["rows"][0]["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="run or checkpoint directory")
    ap.add_argument("--tokens", default="64,256", help="new tokens per generation, comma-separated")
    ap.add_argument("--compile", default="off,on,auto", help="--compile choices to time, comma-separated")
    ap.add_argument("--repeats", type=int, default=2, help="warm runs after the cold one, per setting")
    ap.add_argument("--prompt", default="def parse(")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--src", default=SRC, help="the archlab source tree to time (another checkout's src/ times "
                                               "its code in the same call, for a before/after pair)")
    args = ap.parse_args()

    env = {**os.environ, "PYTHONPATH": str(Path(args.src).resolve()) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows = []
    reference: dict[int, str] = {}
    for n in [int(v) for v in args.tokens.split(",")]:
        for choice in args.compile.split(","):
            with tempfile.TemporaryDirectory() as cache:
                run_env = {**env, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
                           "ARCHLAB_PYCACHE": os.path.join(cache, "pycache")}  # its bytecode cache too
                for i in range(1 + args.repeats):
                    wall, done = archlab("generate", "--ckpt", args.ckpt, "--prompt", args.prompt, "--temperature",
                                         "0", "--max-new-tokens", str(n), "--compile", choice, "--device",
                                         args.device, env=run_env)
                    row = {"new_tokens": n, "compile": choice, "cache": "cold" if i == 0 else "warm",
                           "process_wall_s": wall, **parse_report(done.stderr)}
                    row["tokens_identical"] = reference.setdefault(n, done.stdout) == done.stdout
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    rate = bench_rate(args.ckpt, args.device, env)
    for r in rows:
        r["bench_decode_b1_tokens_per_s"] = rate
        r["frac_of_bench"] = None if r["decode_tokens_per_s"] is None else r["decode_tokens_per_s"] / rate

    print(f"\n`archlab bench decode --batches 1`: {rate:,.0f} tokens/s\n")
    print("| new tokens | --compile | cache | process wall s | load s | first token ms | decode tok/s "
          "| of bench | tokens identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        dec = "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:,.0f}"
        frac = "-" if r["frac_of_bench"] is None else f"{r['frac_of_bench']:.0%}"
        print(f"| {r['new_tokens']} | {r['compile']} | {r['cache']} | {r['process_wall_s']:.1f} | {r['load_s']:.2f} "
              f"| {r['ttft_ms']:,.0f} | {dec} | {frac} | {'yes' if r['tokens_identical'] else 'NO'} |")
    walls = {}
    for r in rows:
        walls.setdefault((r["new_tokens"], r["compile"], r["cache"]), []).append(r["process_wall_s"])
    print("\nmedian process wall s: " + ", ".join(f"{n}/{c}/{k} {statistics.median(v):.1f}"
                                                  for (n, c, k), v in walls.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"bench_decode_b1_tokens_per_s": rate, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
