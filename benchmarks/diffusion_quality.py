"""Generation quality of a uniform-diffusion model beside its autoregressive baseline (issue 31,
the ``diffusion`` suite): the baseline's own perplexity of sampled text and the samples' unigram
entropy, for the diffusion sampler at several step counts and for the baseline sampling itself.

    PYTHONPATH=src python benchmarks/diffusion_quality.py --baseline RUN --diffusion RUN
        [--samples 64] [--length 256] [--steps 32,64,128,256] [--temperature 1] [--batch 16]
        [--seed 0] [--device cuda] [--dtype auto] [--json FILE]
    # a check that it runs, on randomly initialised tiny models (numbers meaningless):
    PYTHONPATH=src python benchmarks/diffusion_quality.py --random-tiny --samples 4 --length 32
        --steps 4,8 --device cpu

Why these metrics. A diffusion model's likelihood is only bounded (``bpb_bound``), so its text is
judged by a model that does have an exact likelihood: the autoregressive baseline trained on the
same data and tokens, whose perplexity of a sample ("generative perplexity") says how plausible
that text is to it. Low generative perplexity is also what repetitive text gets, so each sample's
unigram entropy (nats over the token frequencies within the sample) is printed beside it: a
sampler that collapses onto a few tokens shows a low entropy. The baseline's own samples at the
same temperature are the reference row (its perplexity of its own text is about its entropy
rate). Every sample starts from nothing: the diffusion model from uniform noise with no prompt,
the baseline from the end-of-text token, and the baseline scores every sample after that token.

Sampling compute. The baseline with its KV cache makes ``length`` sequential forward passes of one
token; the diffusion sampler makes ``steps`` passes over all ``length`` tokens. ``steps = length``
is equal sequential passes (the latency-bound comparison on a GPU); in FLOPs a diffusion sample
then costs about ``length`` times more. Both columns are printed (FLOPs by the lab's accounting:
the baseline's decode FLOPs at each context, the denoiser's forward over the whole sequence), so
a reader can pick the matching that fits the question.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from archlab.errors import ArchlabError
from archlab.model import accounting


def step_counts(text: str) -> list[int]:
    try:
        steps = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        steps = []
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"must be whole numbers >= 1, comma-separated, got {text!r}")
    return steps


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def random_tiny_models(device: str):
    """A randomly initialised tiny baseline and diffusion model sharing a 97-token vocabulary."""
    from archlab.model import build_model
    from archlab.model.config import ModelConfig

    shape = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)
    torch.manual_seed(0)
    baseline = build_model(ModelConfig(**shape).validate()).to(device).eval()
    diffusion = build_model(ModelConfig(objective="uniform-diffusion", **shape).validate()).to(device).eval()
    return baseline, diffusion, 0


def load_models(args):
    from archlab.infer.loading import load_for_inference

    baseline, _, eos, _ = load_for_inference(args.baseline, args.device, args.dtype)
    diffusion, _, _, _ = load_for_inference(args.diffusion, args.device, args.dtype)
    if hasattr(baseline.rows, "sample") or not hasattr(diffusion.rows, "sample"):
        raise ArchlabError("--baseline must be an autoregressive checkpoint and --diffusion a model.objective "
                           "uniform-diffusion one")
    if baseline.cfg.vocab_size != diffusion.cfg.vocab_size:
        raise ArchlabError(f"the two checkpoints have different vocabularies ({baseline.cfg.vocab_size} and "
                           f"{diffusion.cfg.vocab_size} tokens); train both on the same data")
    return baseline, diffusion, 0 if eos is None else eos


@torch.no_grad()
def baseline_nll(baseline, samples: torch.Tensor, start: int, batch: int) -> float:
    """The baseline's mean negative log-likelihood (nats/token) of ``samples`` [S, L], each read
    after the token ``start``."""
    total = 0.0
    for chunk in samples.split(batch):
        idx = torch.cat([torch.full_like(chunk[:, :1], start), chunk[:, :-1]], dim=1)
        log_p = baseline.log_probs(baseline(idx))
        total += float(-log_p.gather(-1, chunk[..., None]).sum())
    return total / samples.numel()


def unigram_entropy(samples: torch.Tensor) -> float:
    """Mean over samples of the entropy (nats) of each sample's own token frequencies."""
    out = []
    for row in samples:
        p = torch.bincount(row).double()
        p = p[p > 0] / row.numel()
        out.append(float(-(p * p.log()).sum()))
    return sum(out) / len(out)


@torch.no_grad()
def sample_baseline(baseline, start: int, n: int, length: int, temperature: float, seed: int,
                    batch: int) -> torch.Tensor:
    from archlab.infer.engine import Engine
    from archlab.infer.sampling import SamplingParams

    engine = Engine(baseline, slots=min(batch, n), compile=False)
    params = [SamplingParams(max_new_tokens=length, temperature=temperature, top_k=0, top_p=1.0, seed=seed + i)
              for i in range(n)]
    requests = engine.generate([[start]] * n, params)
    return torch.tensor([r.tokens[:length] for r in requests], device=baseline.lm_head.weight.device)


@torch.no_grad()
def sample_diffusion(diffusion, n: int, length: int, steps: int, temperature: float, seed: int,
                     batch: int) -> torch.Tensor:
    device = diffusion.lm_head.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = [diffusion.rows.sample(diffusion, [[]] * min(batch, n - i), length, steps, temperature, generator)
            for i in range(0, n, batch)]
    return torch.cat(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="autoregressive run or checkpoint directory")
    p.add_argument("--diffusion", help="model.objective uniform-diffusion run or checkpoint directory")
    p.add_argument("--random-tiny", action="store_true", help="randomly initialised tiny models (a check that it runs)")
    p.add_argument("--samples", type=positive, default=64, help="samples per row (default 64)")
    p.add_argument("--length", type=positive, default=256, help="tokens per sample (default 256)")
    p.add_argument("--steps", type=step_counts, default=[32, 64, 128, 256],
                   help="diffusion step counts, comma-separated (default 32,64,128,256)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of both models (default 1)")
    p.add_argument("--batch", type=positive, default=16, help="samples drawn and scored at once (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.random_tiny == bool(args.baseline or args.diffusion) or (not args.random_tiny and not (
            args.baseline and args.diffusion)):
        print("diffusion_quality: give --baseline and --diffusion, or --random-tiny", file=sys.stderr)
        return 2
    if args.temperature <= 0:
        print("diffusion_quality: --temperature must be positive (both samplers draw)", file=sys.stderr)
        return 2
    try:
        baseline, diffusion, start = random_tiny_models(args.device) if args.random_tiny else load_models(args)
    except ArchlabError as e:
        print(f"diffusion_quality: {e}", file=sys.stderr)
        return 2
    context = min(baseline.cfg.max_seq_len, diffusion.cfg.max_seq_len)
    if args.length + 1 > context:
        print(f"diffusion_quality: --length must leave one position of the models' context of {context}",
              file=sys.stderr)
        return 2

    n, length = args.samples, args.length
    ar_flops = sum(accounting.decode_flops_per_token(baseline.cfg, c) for c in range(1, length + 1))
    denoise_flops = length * accounting.decode_flops_per_token(diffusion.cfg, length)  # one pass, all keys
    rows = []
    draws = [("autoregressive", None, sample_baseline(baseline, start, n, length, args.temperature, args.seed,
                                                        args.batch))]
    draws += [("uniform-diffusion", s, sample_diffusion(diffusion, n, length, s, args.temperature, args.seed,
                                                        args.batch)) for s in args.steps]
    for name, steps, samples in draws:
        nll = baseline_nll(baseline, samples, start, args.batch)
        rows.append({"sampler": name, "steps": steps, "sequential_passes": length if steps is None else steps,
                     "flops_per_sample": ar_flops if steps is None else steps * denoise_flops,
                     "gen_ppl": math.exp(nll), "baseline_nll": nll, "unigram_entropy": unigram_entropy(samples),
                     "samples": n, "length": length})

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"generation quality: {n} samples of {length} tokens at temperature {args.temperature}, "
                        f"scored by the baseline (generative perplexity; lower is more plausible to it)")
    for col in ("sampler", "steps", "sequential passes", "FLOPs / sample", "gen. perplexity", "unigram entropy"):
        table.add_column(col, justify="left" if col == "sampler" else "right")
    for r in rows:
        table.add_row(r["sampler"], "-" if r["steps"] is None else str(r["steps"]), str(r["sequential_passes"]),
                      f"{r['flops_per_sample']:.3g}", f"{r['gen_ppl']:.2f}", f"{r['unigram_entropy']:.3f}")
    Console().print(table)
    print("the autoregressive row samples with its KV cache (one token per pass); a diffusion row's passes each "
          "denoise the whole sequence; unigram entropy guards against repetitive text scoring well")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
