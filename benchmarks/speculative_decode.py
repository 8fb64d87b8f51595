"""Self-speculative decoding against plain decoding on the engine: tokens/s, acceptance rate and
tokens per verify step for a few draft settings, at batch 1 and 8, for given checkpoints or for
a quick training of a preset with and without layer dropout.

    PYTHONPATH=src python benchmarks/speculative_decode.py --ckpt RUN [--ckpt RUN2 ...] [--data DIR]
        [--drafts 2:2,2:4,4:4] [--batches 1,8] [--prompt 128] [--new-tokens 128] [--temperature 0]
        [--device cuda] [--dtype auto] [--json FILE]
    PYTHONPATH=src python benchmarks/speculative_decode.py --preset 124m --data DIR --train-steps N
        [--p-max 0.2] [--out DIR] [--set KEY=VALUE ...] ...

* ``--drafts``: ``k:K`` pairs, a draft of ``k`` layer visits (an early exit) proposing ``K``
  tokens per step. A pair whose ``k`` is not an exit point before a model's last visit is left
  out for that model, said in the table.
* Prompts: the first ``--prompt`` tokens of consecutive validation windows of ``--data``, one per
  sequence; without ``--data``, random tokens (a trained model's acceptance then says little).
* ``--train-steps N``: trains ``--preset`` on ``--data`` twice, N steps each, as it is
  (``baseline``) and with ``model.schedule=layer_dropout`` (``p_max`` ``--p-max``; the LayerSkip
  recipe that makes shallow exits good drafts), into ``--out`` (default: a temporary directory),
  then measures both final checkpoints.
* Each row: plain decoding's tokens/s (the engine's compiled CUDA graph on CUDA), the speculative
  engine's tokens/s when no draft may be accepted (``K=0``: the same compiled step, its drafts
  computed and discarded, one token per step: what the machinery costs with nothing gained),
  speculative tokens/s, speed-up, acceptance
  (accepted / drafted tokens), tokens per verify step per sequence and, when greedy, whether
  every sequence's tokens equal plain decoding's in the same run (``no`` would be a bug in fp32;
  in bf16 the verify's multi-token kernels round differently from the one-token step and a
  near-tie may flip).

On CPU, to check that it runs: ``--preset tiny --device cpu`` with small ``--prompt`` and
``--new-tokens``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from archlab.errors import ArchlabError
from archlab.infer.bench import as_dict, bench_speculative, prompt_tokens
from archlab.infer.loading import load_for_inference
from archlab.infer.speculative import SpeculativeOptions


def draft_pairs(text: str) -> list[tuple[int, int]]:
    """``2:2,2:4`` -> [(2, 2), (2, 4)]: (draft layer visits k, draft tokens K), each at least 1."""
    try:
        pairs = [tuple(int(v) for v in item.split(":")) for item in text.split(",") if item.strip()]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"must be k:K pairs of whole numbers >= 1, comma-separated, got {text!r}")
    return pairs  # type: ignore[return-value]


def batch_sizes(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be whole numbers >= 1, comma-separated, got {text!r}")
    return values


def train_pair(preset: str, data: str, steps: int, p_max: float, out: Path, device: str,
               extra: list[str]) -> dict[str, Path]:
    """The baseline and layer-dropout runs of ``preset``, ``steps`` steps each: name -> run dir."""
    from archlab.config import make_config
    from archlab.train.trainer import train

    runs = {}
    for name, overrides in (("baseline", []),
                            (f"layer-dropout-{p_max:g}", ["model.schedule=layer_dropout",
                                                          f"model.layer_dropout.p_max={p_max}"])):
        cfg = make_config(preset, overrides=[f"data.path={data}", f"train.steps={steps}", f"train.ckpt_every={steps}",
                                             f"train.eval_every={steps}", f"train.device={device}", *overrides,
                                             *extra])
        print(f"training {name} ({preset}, {steps} steps) into {out / name}", file=sys.stderr, flush=True)
        result = train(cfg, out / name, show_progress=False)
        print(f"  val loss {result.final_val_loss:.4f}", file=sys.stderr, flush=True)
        runs[name] = out / name
    return runs


def prompts_for(data: str | None, batch: int, length: int, vocab: int) -> list[list[int]]:
    if data is None:
        return [prompt_tokens(length, vocab, seed=i) for i in range(batch)]
    from archlab.data.loader import TokenData

    x, _ = TokenData(data).val_batches(1, batch, length)[0]
    if len(x) < batch:
        raise ArchlabError(f"{data}: the val split holds {len(x)} windows of {length} tokens, not {batch}")
    return x.tolist()


def measure(name: str, ckpt: Path, args) -> list[dict]:
    model, _, _, _ = load_for_inference(ckpt, args.device, args.dtype)
    rows = []
    visits = len(model.visits)
    exits = [n for n in model.exit_points if n < visits]
    for batch in args.batches:
        prompts = prompts_for(args.data, batch, args.prompt, model.cfg.vocab_size)
        for k, K in args.drafts:
            if k not in exits:
                rows.append({"model": name, "batch": batch, "draft_layers": k, "draft_tokens": K,
                             "skipped": f"k={k} is not an exit before the last of {visits} visits"})
                continue
            with torch.no_grad():
                r = as_dict(bench_speculative(model, batch, args.prompt, args.new_tokens,
                                              SpeculativeOptions(draft_tokens=K, draft_layers=k),
                                              args.temperature, prompts))
            rows.append({"model": name, **r})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", action="append", default=[], help="run or checkpoint directory (repeatable)")
    ap.add_argument("--data", help="prepared data: prompts from its val split, and the training data")
    ap.add_argument("--preset", default="tiny", help="with --train-steps: the preset to train")
    ap.add_argument("--train-steps", type=int, default=0, help="train the preset with and without layer dropout")
    ap.add_argument("--p-max", type=float, default=0.2, help="layer dropout's p_max for --train-steps")
    ap.add_argument("--out", help="with --train-steps: where the two runs go (default: a temporary directory)")
    ap.add_argument("--set", action="append", default=[], dest="extra", help="more config overrides for training")
    ap.add_argument("--drafts", type=draft_pairs, default=draft_pairs("2:2,2:4,4:4"), help="k:K pairs")
    ap.add_argument("--batches", type=batch_sizes, default=[1, 8])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sequence")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs checked identical)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA), float32, bfloat16")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    if args.train_steps < 0 or args.prompt < 1 or args.new_tokens < 1 or not args.temperature >= 0:
        ap.error("--train-steps must be >= 0, --prompt and --new-tokens >= 1, --temperature >= 0")
    if args.train_steps and not args.data:
        ap.error("--train-steps needs --data (the corpus to train on)")
    if not args.ckpt and not args.train_steps:
        ap.error("give --ckpt RUN (repeatable) or --train-steps N with --data")
    try:
        runs = {Path(c).name: Path(c) for c in args.ckpt}
        if args.train_steps:
            out = Path(args.out or tempfile.mkdtemp(prefix="speculative-"))
            runs.update(train_pair(args.preset, args.data, args.train_steps, args.p_max, out, args.device, args.extra))
        rows = [row for name, ckpt in runs.items() for row in measure(name, ckpt, args)]
    except ArchlabError as e:
        print(f"speculative_decode: {e}", file=sys.stderr)
        sys.exit(2)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
    print(f"\n{where}, torch {torch.__version__}, {args.new_tokens} new tokens after {args.prompt} "
          f"({'val prompts' if args.data else 'random prompts'}), {how}, dtype {args.dtype}\n")
    print("| model | batch | k:K | plain tok/s | K=0 tok/s | speculative tok/s | speed-up | acceptance "
          "| tokens/step | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pair = f"{r['draft_layers']}:{r['draft_tokens']}"
        if "skipped" in r:
            print(f"| {r['model']} | {r['batch']} | {pair} | skipped: {r['skipped']} | | | | | | |")
            continue
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "no")
        print(f"| {r['model']} | {r['batch']} | {pair} | {r['plain_tokens_per_s']:,.1f} | "
              f"{r['no_draft_tokens_per_s']:,.1f} | "
              f"{r['tokens_per_s']:,.1f} | {r['speedup']:.2f}x | {r['acceptance']:.1%} | {r['tokens_per_step']:.2f} "
              f"| {same} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
