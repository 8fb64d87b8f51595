"""Measured inference cost of a model, through the engine that serves it.

``archlab bench``, ``benchmarks/decode_latency.py`` and the lab's cost columns all call these, so
every latency archlab reports is the engine's. Times are medians of CUDA-event intervals after
warm-up (wall clock on CPU). Each figure comes with its roofline: decode against the bytes a
step must read (``accounting.decode_bytes_per_step``) over the measured copy bandwidth, prefill
against the detected device's peak FLOP/s.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from archlab.infer.engine import Engine
from archlab.infer.sampling import SamplingParams
from archlab.infer.speculative import SpeculationStats, SpeculativeOptions
from archlab.model.accounting import decode_bytes_per_step, prefill_flops_per_token


def _timer(device: torch.device) -> Callable[[Callable[[], object], int, int], float]:
    def cuda_ms(fn, reps: int, warm: int) -> float:
        for _ in range(warm):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    def wall_ms(fn, reps: int, warm: int) -> float:
        for _ in range(warm):
            fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    return cuda_ms if device.type == "cuda" else wall_ms


def copy_bandwidth(device: torch.device, mib: int = 1024) -> float:
    """Measured device-to-device copy bandwidth, bytes/s (read + write counted)."""
    if device.type != "cuda":
        return float("nan")
    n = mib * (1 << 20) // 4
    a = torch.empty(n, device=device)
    b = torch.empty_like(a)
    ms = _timer(device)(lambda: b.copy_(a), 20, 5)
    return 2 * a.numel() * 4 / (ms / 1e3)


def prompt_tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt (latency does not depend on which tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


@dataclass
class PrefillResult:
    prompt: int
    batch: int
    ms: float  # prompts in, first token chosen (time to first token without queueing)
    tokens_per_s: float
    mfu: float | None


@dataclass
class DecodeResult:
    batch: int
    context: int
    ms_per_step: float  # one new token for every sequence of the batch
    tokens_per_s: float
    roofline_ms: float | None  # decode_bytes_per_step / measured copy bandwidth
    frac_of_roofline: float | None


def bench_prefill(model, prompt: int, batch: int = 1, reps: int = 10) -> PrefillResult:
    from archlab.io.device import peak_flops

    eng = Engine(model, slots=batch, max_len=max(prompt + 1, model.cfg.max_seq_len))
    prompts = [prompt_tokens(prompt, model.cfg.vocab_size, seed=i) for i in range(batch)]
    params = [SamplingParams(max_new_tokens=1, temperature=0)] * batch
    rows = list(range(batch))
    ms = _timer(eng.device)(lambda: eng.prefill(rows, prompts, params), reps, 3)
    peak = peak_flops(eng.device)
    flops = prefill_flops_per_token(model.cfg, prompt) * prompt * batch
    return PrefillResult(prompt=prompt, batch=batch, ms=ms, tokens_per_s=prompt * batch / (ms / 1e3),
                         mfu=flops / (ms / 1e3) / peak if peak else None)


def bench_decode(model, batch: int, context: int, steps: int = 100, bandwidth: float | None = None,
                 dtype_bytes: int | None = None, compile_mode: str | None = None) -> DecodeResult:
    """Decode steps of ``batch`` sequences whose caches hold ``context`` tokens (the step's position
    advances by one each step, starting at ``context``); ``compile_mode`` is the engine's."""
    eng = Engine(model, slots=batch, max_len=context + steps + 16, compile_mode=compile_mode)
    prompts = [prompt_tokens(context, model.cfg.vocab_size, seed=i) for i in range(batch)]
    eng.prefill(list(range(batch)), prompts, [SamplingParams(max_new_tokens=steps + 1, temperature=0)] * batch)
    timer = _timer(eng.device)
    start = eng.positions.clone()

    def one():
        eng.step(greedy=True)

    ms = timer(one, steps, 8)
    eng.positions.copy_(start)
    nbytes = dtype_bytes or model.lm_head.weight.element_size()
    roof = None
    if bandwidth and bandwidth == bandwidth:  # not NaN
        roof = decode_bytes_per_step(model.cfg, context, batch, nbytes) / bandwidth * 1e3
    return DecodeResult(batch=batch, context=context, ms_per_step=ms, tokens_per_s=batch / (ms / 1e3),
                        roofline_ms=roof, frac_of_roofline=roof / ms if roof else None)


@dataclass
class SpeculativeResult:
    batch: int
    context: int  # prompt tokens per sequence
    new_tokens: int  # generated per sequence
    draft_tokens: int  # K
    draft_layers: int  # k
    visits: int  # layer visits of the full model
    temperature: float
    plain_tokens_per_s: float  # the engine's plain decoding (a CUDA graph on CUDA)
    #: the speculative engine with every request at ``speculate=0``: the same step (its drafts
    #: computed, none accepted), one token per step: what the step costs with nothing gained
    no_draft_tokens_per_s: float
    tokens_per_s: float  # self-speculative decoding
    speedup: float  # tokens_per_s / plain_tokens_per_s
    acceptance: float  # accepted draft tokens / drafted
    tokens_per_step: float  # tokens a sequence gains per verify pass
    identical: bool | None  # greedy: every sequence's tokens equal plain decoding's (None when sampling)


def decode_rate(engine: Engine, prompts: list[list[int]],
                params: list[SamplingParams]) -> tuple[float, list[list[int]]]:
    """(tokens/s after the first token, the tokens) of generating ``prompts`` on ``engine``, after
    an untimed run of a few tokens that compiles and captures what the engine needs."""
    engine.generate(prompts, [dataclasses.replace(p, max_new_tokens=min(4, p.max_new_tokens)) for p in params])
    if engine.speculative is not None:
        engine.speculative.stats = SpeculationStats()  # the timed run's alone
    requests = engine.generate(prompts, params)
    end = time.perf_counter()  # generate has read every token back: the device is done
    start = max(r.first_token_at for r in requests)  # every prompt is admitted in one prefill
    decoded = sum(len(r.tokens) - 1 for r in requests)
    return decoded / (end - start), [r.tokens for r in requests]


def bench_speculative(model, batch: int, context: int, new_tokens: int, options: SpeculativeOptions,
                      temperature: float = 0.0, prompts: list[list[int]] | None = None) -> SpeculativeResult:
    """Plain and self-speculative decoding of the same ``batch`` prompts (``prompts``, or random
    ones of ``context`` tokens), ``new_tokens`` each, seeds 0..batch-1."""
    prompts = prompts or [prompt_tokens(context, model.cfg.vocab_size, seed=i) for i in range(batch)]
    params = [SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=i) for i in range(len(prompts))]
    max_len = max(len(p) for p in prompts) + new_tokens + 16
    slots = len(prompts)
    plain_rate, plain = decode_rate(Engine(model, slots=slots, max_len=max_len), prompts, params)
    engine = Engine(model, slots=slots, max_len=max_len, speculate=options)
    no_draft = decode_rate(engine, prompts, [dataclasses.replace(p, speculate=0) for p in params])[0]
    rate, tokens = decode_rate(engine, prompts, params)
    spec, stats = engine.speculative, engine.speculative.stats
    return SpeculativeResult(batch=slots, context=max(len(p) for p in prompts), new_tokens=new_tokens,
                             draft_tokens=spec.draft_tokens, draft_layers=spec.draft_layers,
                             visits=len(model.visits), temperature=temperature, plain_tokens_per_s=plain_rate,
                             no_draft_tokens_per_s=no_draft, tokens_per_s=rate, speedup=rate / plain_rate,
                             acceptance=stats.acceptance, tokens_per_step=stats.tokens_per_step,
                             identical=tokens == plain if temperature == 0 else None)


@dataclass
class PairedTTFT:
    """Time to first token of two models measured in alternation (``paired_ttft``): medians and
    interquartile ranges of each, and of the per-pair ratio b / a."""
    prompt: int
    pairs: int
    a_ms: float
    a_iqr_ms: tuple[float, float]
    b_ms: float
    b_iqr_ms: tuple[float, float]
    ratio: float  # median of b_i / a_i over the pairs
    ratio_iqr: tuple[float, float]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile), linearly interpolated between order statistics
    (``statistics.quantiles``'s inclusive method, numpy's default)."""
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarise_pairs(prompt: int, a_ms: list[float], b_ms: list[float]) -> PairedTTFT:
    """The statistics of paired timings: a ratio per pair, so that drift of the machine between
    pairs (clocks, other tenants, the bimodal prefill times seen on an H200) cancels within one."""
    if len(a_ms) != len(b_ms) or len(a_ms) < 2:
        raise ValueError("paired timings need two lists of equal length, at least 2")
    ratios = [b / a for a, b in zip(a_ms, b_ms)]
    (a1, a2, a3), (b1, b2, b3), (r1, r2, r3) = quartiles(a_ms), quartiles(b_ms), quartiles(ratios)
    return PairedTTFT(prompt=prompt, pairs=len(a_ms), a_ms=a2, a_iqr_ms=(a1, a3), b_ms=b2, b_iqr_ms=(b1, b3),
                      ratio=r2, ratio_iqr=(r1, r3))


def paired_ttft(model_a, model_b, prompt: int, pairs: int = 30, warm: int = 3) -> PairedTTFT:
    """Time to first token (one prefill of a ``prompt``-token prompt and the first token's
    sampling) of two models on their own engines, measured as ``pairs`` pairs: each pair a fresh
    prompt of the same length given to both, the order alternating from pair to pair (a, b then
    b, a), so that neither model always runs first (after the other's work, in a warmer or a
    cooler state). One pair of timings is not a measurement: the same prefill has been seen to
    take two distinct times from one process to the next."""
    engines = [Engine(m, slots=1, max_len=max(prompt + 1, m.cfg.max_seq_len)) for m in (model_a, model_b)]
    vocab = min(model_a.cfg.vocab_size, model_b.cfg.vocab_size)
    params = [SamplingParams(max_new_tokens=1, temperature=0)]
    timer = _timer(engines[0].device)
    for i, engine in enumerate(engines):  # compile and capture the prefill of this length
        timer(lambda: engine.prefill([0], [prompt_tokens(prompt, vocab, seed=10_000 + i)], params), 1, warm)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(pairs):
        tokens = prompt_tokens(prompt, vocab, seed=i)
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            engine = engines[which]
            times[which].append(timer(lambda: engine.prefill([0], [tokens], params), 1, 0))
    return summarise_pairs(prompt, *times)


def baseline_and_branch(preset: str, max_len: int, overrides: list[str], device: torch.device,
                        dtype: torch.dtype):
    """(baseline, decode-branch) of a preset for latency comparisons: the baseline holds the
    branch model's shared weights, and the branch's coupling vectors are random (trained ones are
    non-zero; at their zero init the branch rows would cost the same but compute nothing new)."""
    from archlab.config import make_config
    from archlab.model import build_model

    over = [f"model.max_seq_len={max_len}", *overrides]
    torch.manual_seed(0)
    branch = build_model(make_config(preset, overrides=[*over, "model.branch.enabled=true"]).model)
    for name, p in branch.named_parameters():
        if ".couple_" in name:
            torch.nn.init.normal_(p, 0.0, 0.02)
    base = build_model(make_config(preset, overrides=over).model)
    base.load_state_dict({k: v for k, v in branch.state_dict().items() if k in base.state_dict()})
    return base.to(device, dtype).eval(), branch.to(device, dtype).eval()


def as_dict(result) -> dict:
    return asdict(result)
