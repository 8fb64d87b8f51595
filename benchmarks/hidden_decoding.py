"""Hidden Decoding against the baseline (and the decode branch): training throughput and memory,
time to first token and decode ms/token on the inference engine, per preset, in one process.

    python benchmarks/hidden_decoding.py --presets 124m,1b --streams 2,4 --batches 1,8 \
        --context 1024 --prompt 1024 --train-presets 124m

Training rows (``--train-presets``): tokens/s of a full training step (forward, backward, fused
AdamW) on random tokens at ``--train-batch`` x ``--seq-len`` scored tokens, bf16 autocast and
``torch.compile`` on CUDA, with the peak allocated memory of the step; Hidden Decoding runs
``n`` rows per scored token, so its tokens/s counts scored tokens. Inference rows run through
``archlab.infer.bench`` (the engine ``archlab serve`` and ``archlab bench`` use: a compiled
prefill per length bucket, the decode step captured as a CUDA graph): prefill of a ``--prompt``
token prompt at batch 1 (time to first token) and decode ms per step at each of ``--batches``
with ``--context`` tokens in the cache, for the baseline, the decode branch and Hidden Decoding
with each of ``--streams`` (its default mixing layer: the middle one). Weights are random: these
are costs, not quality. Prints a Markdown table per kind and one JSON object per row.

On a machine without CUDA it runs the same measurements on CPU in float32, eager and wall-clock
timed; ``--presets tiny --train-presets tiny`` with short shapes proves the script in seconds:

    python benchmarks/hidden_decoding.py --presets tiny --train-presets tiny --seq-len 64 \
        --train-batch 4 --prompt 64 --context 64 --batches 1,2 --decode-steps 8 --train-steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from archlab.config import make_config  # noqa: E402
from archlab.infer.bench import bench_decode, bench_prefill  # noqa: E402
from archlab.model import build_model  # noqa: E402


def variants(streams: list[int]) -> dict[str, list[str]]:
    """Label -> config overrides: the baseline, the decode branch, Hidden Decoding per n."""
    out = {"baseline": [], "decode-branch": ["model.branch.enabled=true"]}
    for n in streams:
        out[f"hidden-{n}"] = ["model.hidden_decoding.enabled=true", f"model.hidden_decoding.streams={n}"]
    return out


def build(preset: str, overrides: list[str], max_len: int, device: torch.device, dtype: torch.dtype):
    torch.manual_seed(0)
    # train.seq_len follows the context: a preset's own may exceed a short benchmark context
    cfg = make_config(preset, overrides=[f"model.max_seq_len={max_len}", f"train.seq_len={max_len}",
                                         *overrides]).model
    return build_model(cfg).to(device, dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train_row(model, batch: int, seq_len: int, steps: int, warmup: int, device: torch.device) -> dict:
    """Scored tokens/s and peak memory of training steps on random tokens."""
    model.train()
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    step_fn = torch.compile(model) if cuda else model
    vocab = model.cfg.vocab_size
    x = torch.randint(0, vocab, (batch, seq_len), device=device)
    y = torch.randint(0, vocab, (batch, seq_len), device=device)

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
            loss = step_fn(x, y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    del opt
    return {"tokens_per_s": batch * seq_len / s, "step_ms": s * 1e3, "peak_gib": peak}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="124m,1b", help="presets of the inference rows (comma-separated)")
    ap.add_argument("--train-presets", default="124m", help="presets of the training rows ('' for none)")
    ap.add_argument("--streams", default="2,4", help="Hidden Decoding stream counts")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=1024, help="tokens in the cache for decode")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens of the prefill (time to first token)")
    ap.add_argument("--decode-steps", type=int, default=100, help="timed decode steps per batch size")
    ap.add_argument("--seq-len", type=int, default=1024, help="training sequence length")
    ap.add_argument("--train-batch", type=int, default=16, help="training sequences per step")
    ap.add_argument("--train-steps", type=int, default=10, help="timed training steps")
    ap.add_argument("--train-warmup", type=int, default=3, help="untimed training steps first (compilation)")
    ap.add_argument("--labels", help="only these labels (comma-separated: baseline, decode-branch, hidden-N); the "
                    "baseline always runs, since every ratio is to it")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    streams = [int(n) for n in args.streams.split(",")]
    labels = variants(streams)
    if args.labels:
        keep = {"baseline", *args.labels.split(",")}
        unknown = keep - set(labels)
        if unknown:
            ap.error(f"--labels: unknown {', '.join(sorted(unknown))} (known: {', '.join(labels)})")
        labels = {k: v for k, v in labels.items() if k in keep}
    batches = [int(b) for b in args.batches.split(",")]
    print(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}),
          flush=True)
    rows = []
    for preset in [p for p in args.train_presets.split(",") if p]:
        base = None
        for label, over in labels.items():
            if label == "decode-branch":
                continue  # the branch's training cost is measured in benchmarks/train_throughput.py
            model = build(preset, over, args.seq_len, device, torch.float32)
            r = {"kind": "train", "preset": preset, "variant": label,
                 **train_row(model, args.train_batch, args.seq_len, args.train_steps, args.train_warmup, device)}
            base = base or r
            r["vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]
            rows.append(r)
            print(json.dumps(r), flush=True)
            del model
            if cuda:
                torch.cuda.empty_cache()
    max_len = max(args.prompt + 1, args.context + args.decode_steps + 16)
    with torch.no_grad():
        for preset in [p for p in args.presets.split(",") if p]:
            refs: dict[str, float] = {}
            for label, over in labels.items():
                model = build(preset, over, max_len, device, dtype).eval()
                r = {"kind": "infer", "preset": preset, "variant": label,
                     "ttft_ms": bench_prefill(model, args.prompt).ms}
                for b in batches:
                    r[f"decode_ms_b{b}"] = bench_decode(model, b, args.context, args.decode_steps).ms_per_step
                for key in [k for k in r if k.endswith("_ms") or k.startswith("decode_ms")]:
                    refs.setdefault(key, r[key])
                    r[f"{key}_vs_baseline"] = r[key] / refs[key]
                rows.append(r)
                print(json.dumps(r), flush=True)
                del model
                if cuda:
                    torch.cuda.empty_cache()
    print_tables(rows, batches)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def print_tables(rows: list[dict], batches: list[int]) -> None:
    train = [r for r in rows if r["kind"] == "train"]
    if train:
        print("\n| preset | variant | tokens/s | vs baseline | step ms | peak GiB |\n|---|---|---|---|---|---|")
        for r in train:
            print(f"| {r['preset']} | {r['variant']} | {r['tokens_per_s']:,.0f} | {r['vs_baseline']:.3f} | "
                  f"{r['step_ms']:.1f} | {_fmt(r['peak_gib'], '.2f')} |")
    infer = [r for r in rows if r["kind"] == "infer"]
    if infer:
        head = "".join(f" decode ms b{b} | vs base |" for b in batches)
        print(f"\n| preset | variant | TTFT ms | vs base |{head}\n|---|---|---|---|" + "---|---|" * len(batches))
        for r in infer:
            cells = "".join(f" {r[f'decode_ms_b{b}']:.3f} | {r[f'decode_ms_b{b}_vs_baseline']:.3f} |" for b in batches)
            print(f"| {r['preset']} | {r['variant']} | {r['ttft_ms']:.2f} | {r['ttft_ms_vs_baseline']:.3f} |{cells}")


if __name__ == "__main__":
    main()
