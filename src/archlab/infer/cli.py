"""Command line of inference: ``generate``, ``serve`` and ``bench``, all on the engine."""

from __future__ import annotations

import argparse
import json
import os
import sys

from archlab.argtypes import config_args, int_at_least, non_negative_float, non_negative_int, positive_int, unit_float
from archlab.errors import UsageError


# ``--compile auto`` compiles the decode step when a generation has at least this many steps: a
# compiled step fuses its kernels, but compiling it costs seconds, which a short
# generation does not win back (an eager step is still captured as a CUDA graph). The threshold
# is a first choice, to be set from GPU measurements (docs/benchmarks.md).
AUTO_COMPILE_MIN_STEPS = 256


def use_compile(choice: str, device_type: str, max_new_tokens: int) -> bool:
    """``--compile``: on, off, or auto (on CUDA for generations of ``AUTO_COMPILE_MIN_STEPS`` steps
    or more; never on CPU, where inductor's C++ compile takes tens of seconds)."""
    if choice != "auto":
        return choice == "on"
    return device_type == "cuda" and max_new_tokens >= AUTO_COMPILE_MIN_STEPS


def cmd_generate(args) -> int:
    import time

    from archlab.infer.engine import Engine
    from archlab.infer.loading import load_for_inference
    from archlab.infer.sampling import SamplingParams

    speculate = speculative_options(args)
    started = time.perf_counter()
    model, tok, eos, _ = load_for_inference(args.ckpt, args.device, args.dtype)
    loaded = time.perf_counter()
    if hasattr(model.rows, "sample") or args.diffusion_steps is not None:  # a model that samples whole sequences
        return generate_by_denoising(args, model, tok, eos, loaded - started)
    compiled = use_compile(args.compile, model.lm_head.weight.device.type, args.max_new_tokens)
    # One prefill per generation: compiling it would cost seconds for a shape used once.
    engine = Engine(model, slots=len(args.prompt), speculate=speculate, compile=compiled, compile_prefill=False)
    ctx = engine.max_len  # speculation keeps one slot of the model's context (infer.speculative)
    if args.max_new_tokens >= ctx:
        raise UsageError(f"--max-new-tokens must be below the model's context of {ctx} tokens "
                         f"(room is needed for the prompt), got {args.max_new_tokens}")
    prompts = [tok.encode(p).ids or ([eos] if eos is not None else [0]) for p in args.prompt]
    room = ctx - args.max_new_tokens + 1
    if any(len(p) > room for p in prompts):  # keep the prompt's end, as a sliding window would
        print(f"archlab: a prompt was cut to its last {room} tokens to fit the context of {ctx}", file=sys.stderr)
        prompts = [p[-room:] for p in prompts]
    stops = tuple(tok.encode(s).ids[0] for s in args.stop if tok.encode(s).ids)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, stop_tokens=stops + ((eos,) if eos is not None else ()), seed=args.seed)
    clock = GenerationClock()
    t0 = time.perf_counter()
    requests = engine.generate(prompts, params, on_token=clock.on_token)
    wall = time.perf_counter() - t0
    for text, r in zip(args.prompt, requests):
        print(text + tok.decode([t for t in r.tokens if t != eos]))
        if len(args.prompt) > 1:
            print("-" * 40)
    print(clock.report(loaded - started, t0, wall, requests, sum(len(p) for p in prompts), compiled, engine.cuda),
          file=sys.stderr)
    if engine.speculative is not None:
        spec, stats = engine.speculative, engine.speculative.stats
        print(f"speculative: {spec.draft_tokens} draft tokens per step from {spec.draft_layers} of "
              f"{len(model.visits)} layer visits: acceptance {stats.acceptance:.1%} ({stats.accepted} of "
              f"{stats.drafted} drafted tokens), {stats.tokens_per_step:.2f} tokens per verify step", file=sys.stderr)
    return 0


def generate_by_denoising(args, model, tok, eos, load_s: float) -> int:
    """``generate`` for a ``model.objective: uniform-diffusion`` checkpoint: ``--diffusion-steps``
    reverse steps from uniform noise over the longest prompt and ``--max-new-tokens`` more
    positions. Each prompt stays fixed at its row's start and the denoiser fills in the rest; the
    ``--max-new-tokens`` after the prompt are printed."""
    import time

    import torch

    sample = getattr(model.rows, "sample", None)
    if sample is None:
        raise UsageError("--diffusion-steps samples a model.objective uniform-diffusion checkpoint; this one "
                         "predicts the next token (leave --diffusion-steps out)")
    if args.diffusion_steps is None:
        raise UsageError("this checkpoint is a model.objective uniform-diffusion denoiser, which samples whole "
                         "sequences: give --diffusion-steps N (reverse steps from noise to text)")
    if args.speculate is not None or args.draft_layers is not None:
        raise UsageError("--speculate drafts tokens left to right; a diffusion model samples whole sequences")
    prompts = [tok.encode(p).ids for p in args.prompt]
    length = max(len(p) for p in prompts) + args.max_new_tokens
    context = model.cfg.max_seq_len
    if length > context:
        raise UsageError(f"the longest prompt ({length - args.max_new_tokens} tokens) and --max-new-tokens "
                         f"({args.max_new_tokens}) must fit the model's context of {context} tokens")
    generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(args.seed)
    t0 = time.perf_counter()
    tokens = sample(model, prompts, length, args.diffusion_steps, args.temperature, generator).tolist()
    wall = time.perf_counter() - t0
    for text, p, row in zip(args.prompt, prompts, tokens):
        print(text + tok.decode([t for t in row[len(p):len(p) + args.max_new_tokens] if t != eos]))
        if len(args.prompt) > 1:
            print("-" * 40)
    print(f"{args.max_new_tokens} tokens per row by {args.diffusion_steps} denoising steps over {length} positions "
          f"and {len(prompts)} row(s) in {wall:.2f} s after loading in {load_s:.2f} s", file=sys.stderr)
    return 0


class GenerationClock:
    """When each batch of tokens reached the host, to tell start-up from decoding in what
    ``generate`` reports. The first decode steps compile and capture the step (a CUDA graph), so
    a rate over all tokens after the first measured compilation; here the rate is taken from the
    first delivery after the first token (the engine hands tokens over every few steps) to the
    last, and the time before it is reported as what it is."""

    def __init__(self) -> None:
        self.deliveries: list[tuple[float, int]] = []  # (time, tokens delivered up to then)
        self.count = 0

    def on_token(self, request, token: int) -> None:  # noqa: ARG002
        import time

        self.count += 1
        now = time.perf_counter()
        if self.deliveries and now - self.deliveries[-1][0] < 1e-4:  # one hand-over of a batch
            self.deliveries[-1] = (now, self.count)
        else:
            self.deliveries.append((now, self.count))

    def report(self, load_s: float, t0: float, wall: float, requests, prompt_tokens: int, compiled: bool,
               captured: bool) -> str:
        n = sum(len(r.tokens) for r in requests)
        ttft = min(r.first_token_at for r in requests) - t0
        how = "decode step compiled" if compiled else "eager"
        line = (f"{n} tokens in {wall:.2f} s after loading in {load_s:.2f} s ({how}): first token after "
                f"{ttft * 1e3:,.0f} ms (an eager prefill of {prompt_tokens} prompt tokens)")
        later = self.deliveries[1:]  # the first hand-over is the prefill's first tokens
        if len(later) >= 2 and later[-1][1] > later[0][1]:
            (t_a, c_a), (t_b, c_b) = later[0], later[-1]
            setup = t_a - self.deliveries[0][0]
            work = " and ".join(w for w, done in (("compiling", compiled), ("capturing", captured)) if done)
            line += (f", then {c_b - c_a} tokens at {(c_b - c_a) / (t_b - t_a):,.1f} tokens/s over "
                     f"{len(requests)} sequence(s), timed after the first decode hand-over ({setup:.2f} s"
                     + (f", {work} the step on first use)" if work else ")"))
        else:
            line += "; too few tokens after the first to time decoding apart from start-up"
        return line


def speculative_options(args):
    """``--speculate K [--draft-layers k]`` as the engine's options; None without ``--speculate``.
    The values are checked against the model when the engine is built."""
    if args.speculate is None:
        if args.draft_layers is not None:
            raise UsageError("--draft-layers sets the draft of self-speculative decoding: give --speculate K too")
        return None
    from archlab.infer.speculative import SpeculativeOptions

    return SpeculativeOptions(draft_tokens=args.speculate, draft_layers=args.draft_layers)


def server_limits(args):
    """``--api-key`` (else the environment's ``ARCHLAB_API_KEY``) and the bounds on each
    request's work, as the server's ``ServerLimits``; an empty key is refused in one line."""
    from archlab.infer.server_limits import API_KEY_ENV, ServerLimits

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    limits = ServerLimits(api_key=api_key, max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
                          request_timeout=args.request_timeout or None)
    limits.check()
    return limits


def cmd_serve(args) -> int:
    limits = server_limits(args)  # before torch is imported: a bad key is reported at once
    from archlab.infer.server import serve

    serve(args.ckpt, host=args.host, port=args.port, slots=args.slots, device=args.device, dtype=args.dtype,
          model_name=args.model_name, warm_up=not args.no_warm_up, speculate=speculative_options(args),
          limits=limits, stream_interval=args.stream_interval)
    return 0


def cmd_bench(args) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from archlab.infer.bench import as_dict, bench_decode, bench_prefill, copy_bandwidth

    batches = args.batches
    only_speculative = [flag for flag, value in (("--speculate", args.speculate), ("--draft-layers", args.draft_layers),
                                                 ("--temperature", args.temperature)) if value is not None]
    if only_speculative and args.what != "speculative":
        raise UsageError(f"{only_speculative[0]} applies to archlab bench speculative")
    if args.ckpt:
        from archlab.infer.loading import load_for_inference

        model, _, _, label = load_for_inference(args.ckpt, args.device, args.dtype)
    else:
        from archlab.config import make_config
        from archlab.infer.loading import resolve_dtype
        from archlab.io.device import resolve_device
        from archlab.model import build_model

        cfg = make_config(args.preset, args.config, args.overrides)
        dev = resolve_device(args.device)
        torch.manual_seed(0)
        model = build_model(cfg.model).to(dev, resolve_dtype(args.dtype, dev)).eval()
        label = f"preset {args.preset}" + (" with overrides" if args.overrides or args.config else "")
    fit_bench_shapes(args, model.cfg.max_seq_len)
    need = max(args.prompt if args.what in ("prefill", "all") else 0, args.context + args.steps + _DECODE_SLACK)
    if need > model.cfg.max_seq_len:
        raise UsageError(f"--prompt / --context + --steps need {need} positions; the model has "
                         f"{model.cfg.max_seq_len} (raise model.max_seq_len with --set for a preset)")
    dev = model.lm_head.weight.device
    if args.what == "speculative":
        return _bench_speculative(args, model, label)
    rows: list[dict] = []
    bw = copy_bandwidth(dev)
    with torch.no_grad():
        if args.what in ("prefill", "all"):
            rows.append({"kind": "prefill", **as_dict(bench_prefill(model, args.prompt))})
        if args.what in ("decode", "all"):
            for b in batches:
                rows.append({"kind": "decode", **as_dict(bench_decode(model, b, args.context, args.steps, bw))})
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    table = Table(title=f"engine on {device}: {label}" + (f", copy {bw / 1e12:.2f} TB/s" if bw == bw else ""))
    for col in ("phase", "shape", "ms", "tokens/s", "roofline"):
        table.add_column(col, justify="right" if col != "phase" else "left")
    for r in rows:
        if r["kind"] == "prefill":
            roof = f"{r['mfu']:.1%} MFU" if r["mfu"] else "-"
            table.add_row("prefill", f"prompt {r['prompt']}, batch {r['batch']}", f"{r['ms']:.3f}",
                          f"{r['tokens_per_s']:,.0f}", roof)
        else:
            roof = f"{r['frac_of_roofline']:.1%} ({r['roofline_ms']:.3f} ms)" if r["frac_of_roofline"] else "-"
            table.add_row("decode", f"batch {r['batch']}, context {r['context']}", f"{r['ms_per_step']:.3f}",
                          f"{r['tokens_per_s']:,.0f}", roof)
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "model": label, "copy_bytes_per_s": bw, "rows": rows}, f, indent=1)
    return 0


DEFAULT_PROMPT, DEFAULT_CONTEXT = 2048, 1024
_DECODE_SLACK = 16  # positions kept free past context + steps (the warm-up's steps)


def fit_bench_shapes(args, max_len: int) -> None:
    """Fill in ``--prompt`` and ``--context`` left unset: the defaults (2048, 1024) where the
    model's context holds them, else the longest prompt it holds and the longest power-of-two
    context that leaves room for ``--steps``, so that the plain command works on every preset.
    A value the user gave is kept (and refused later if it does not fit)."""
    shrunk = []
    if args.prompt is None:
        args.prompt = min(DEFAULT_PROMPT, max_len)
        if args.prompt != DEFAULT_PROMPT and args.what in ("prefill", "all"):
            shrunk.append(f"prompt {args.prompt}")
    if args.context is None:
        room = max_len - args.steps - _DECODE_SLACK
        args.context = DEFAULT_CONTEXT if DEFAULT_CONTEXT <= room else 1 << max(0, room.bit_length() - 1)
        if args.context != DEFAULT_CONTEXT and args.what != "prefill":
            shrunk.append(f"context {args.context}")
    if shrunk:
        print(f"archlab: bench: {' and '.join(shrunk)}, to fit the model's context of {max_len} tokens",
              file=sys.stderr)


def _bench_speculative(args, model, label: str) -> int:
    """``archlab bench speculative``: plain against self-speculative decoding of the same prompts."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from archlab.infer.bench import as_dict, bench_speculative
    from archlab.infer.speculative import SpeculativeOptions

    options = SpeculativeOptions(draft_tokens=args.speculate or 4, draft_layers=args.draft_layers)
    temperature = args.temperature or 0.0
    with torch.no_grad():
        rows = [as_dict(bench_speculative(model, b, args.context, args.steps, options, temperature))
                for b in args.batches]
    dev = model.lm_head.weight.device
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    draft = f"K={rows[0]['draft_tokens']} drafted by k={rows[0]['draft_layers']} of {rows[0]['visits']} visits"
    table = Table(title=f"self-speculative decoding on {device}: {label}; {draft}; {args.steps} tokens after "
                        f"{args.context}, {'greedy' if temperature == 0 else f'temperature {temperature:g}'}")
    columns = ["batch", "plain tok/s", "K=0 tok/s", "spec tok/s", "vs plain", "accepted", "per step", "same"]
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        same = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        table.add_row(str(r["batch"]), f"{r['plain_tokens_per_s']:,.1f}", f"{r['no_draft_tokens_per_s']:,.1f}",
                      f"{r['tokens_per_s']:,.1f}", f"{r['speedup']:.2f}x", f"{r['acceptance']:.1%}",
                      f"{r['tokens_per_step']:.2f}", same)
    Console().print(table)
    print("plain: the engine's plain step (on CUDA compiled, a CUDA graph); K=0: the speculative step with no "
          "draft accepted (its cost with nothing gained); per step: tokens per verify step; same: greedy tokens "
          "identical to plain decoding's")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "model": label, "rows": rows}, f, indent=1)
    return 0


def port_number(text: str) -> int:
    """A TCP port, 1..65535, or 0: one the system picks (the "serving" line names it)."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0..65535 (0: any free port), got {value}")
    return value


def positive_int_list(text: str) -> list[int]:
    """``1,8`` -> [1, 8]: comma-separated whole numbers, each at least 1."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers, each at least 1, got {text!r}")
    return values


def _speculative_args(p: argparse.ArgumentParser, more: str = "") -> None:
    p.add_argument("--speculate", type=positive_int, metavar="K",
                   help="self-speculative decoding: draft K tokens per step with the model's first layer visits (an "
                        "early exit) and verify them with the full model in one pass; exact: greedy output and the "
                        "sampling distribution are plain decoding's" + more)
    p.add_argument("--draft-layers", type=positive_int, metavar="k",
                   help="with --speculate: layer visits the draft runs, an exit point before the last visit "
                        "(default: the deepest exit at or before half of the visits)")


def _inference_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype (auto: bfloat16 on CUDA, float32 on CPU)")


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="sample continuations from a checkpoint (prints tokens/s and time to first "
                       "token on stderr)")
    g.add_argument("--ckpt", required=True, help="run directory or checkpoint directory")
    g.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch, one row each")
    g.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate per prompt (default 64)")
    g.add_argument("--temperature", type=non_negative_float, default=0.8,
                   help="sampling temperature; 0 = greedy (the most likely token), default 0.8")
    g.add_argument("--top-k", type=int_at_least(0, "0 = off"), default=50, help="sample among the k most likely tokens (0 = off; default 50)")
    g.add_argument("--top-p", type=unit_float, default=0.95,
                   help="sample among the most likely tokens whose probability reaches p (1 = off; default 0.95)")
    g.add_argument("--stop", action="append", default=[],
                   help="stop a row after this text's first token (repeatable); end-of-text always stops")
    g.add_argument("--seed", type=non_negative_int, default=0, help="sampling seed (the same seed gives the same text)")
    g.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="compile the decode step with torch.compile (faster steps, seconds to compile; the "
                        f"one prefill runs eagerly); auto: on CUDA for --max-new-tokens >= {AUTO_COMPILE_MIN_STEPS}, else eager "
                        "(on CUDA still a captured CUDA graph); the same greedy tokens either way")
    g.add_argument("--diffusion-steps", type=positive_int, metavar="N",
                   help="a model.objective uniform-diffusion checkpoint (required for one, refused for others): "
                        "N reverse steps from uniform noise to text over the prompt and --max-new-tokens "
                        "positions, the prompt held fixed; --temperature scales the denoiser's logits, "
                        "--top-k/--top-p/--stop/--compile do not apply")
    _speculative_args(g)
    _inference_args(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve a checkpoint over HTTP: OpenAI-compatible /v1/completions (logprobs, "
                       "echo, n, prompt lists, penalties, logit_bias), /v1/chat/completions (with the checkpoint's "
                       "chat_template.jinja), /v1/models, /health, Prometheus /metrics")
    s.add_argument("--ckpt", required=True,
                   help="run directory or checkpoint directory (a chat_template.jinja beside its tokenizer.json "
                        "enables /v1/chat/completions; without one chat requests get 400)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=port_number, default=8000,
                   help="port to listen on (default 8000; 0: a free port, named in the \"serving\" line)")
    s.add_argument("--slots", type=positive_int, default=16,
                   help="sequences decoded together (KV-cache rows); more requests queue (default 16)")
    s.add_argument("--model-name", help="the model id clients ask for (default: the run directory's name)")
    s.add_argument("--no-warm-up", action="store_true",
                   help="do not compile and capture the decode step before serving (first request pays it)")
    _speculative_args(s, " (a request's archlab field \"speculate\": 0..K accepts fewer)")
    s.add_argument("--api-key", metavar="KEY",
                   help="require the header Authorization: Bearer KEY on every route but /health (401 without it); "
                        "default: the environment variable ARCHLAB_API_KEY, which keeps the key out of the process "
                        "list; without a key a --host other than loopback prints a warning")
    s.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, metavar="N",
                   help="the largest request body; a larger one gets 413 (default 1048576, 1 MiB)")
    s.add_argument("--max-queue", type=non_negative_int, default=256, metavar="N",
                   help="requests that may wait for a slot; past them a request gets 429 with Retry-After "
                        "(default 256)")
    s.add_argument("--request-timeout", type=non_negative_float, default=600.0, metavar="SECONDS",
                   help="time limit of one request from its arrival, its wait for a slot included: past it the "
                        "request ends with the text so far and finish_reason \"length\", and its slot frees "
                        "(default 600; 0: no limit)")
    s.add_argument("--stream-interval", type=positive_int, default=1, metavar="N",
                   help="streamed responses send an event every N tokens after the first (which goes at once) and "
                        "at the end: fewer, larger events for clients that need not see every token (default 1)")
    _inference_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="measure prefill and decode latency of a checkpoint or preset on the engine")
    b.add_argument("what", choices=["prefill", "decode", "all", "speculative"],
                   help="which phase to measure; speculative: plain against self-speculative decoding of --steps "
                        "new tokens after --context prompt tokens (acceptance, tokens per verify step, tokens/s)")
    b.add_argument("--ckpt", help="run directory or checkpoint directory (default: a randomly initialised --preset)")
    config_args(b, " when no --ckpt (randomly initialised)")
    b.add_argument("--prompt", type=positive_int,
                   help="prefill prompt length in tokens (default 2048, or the model's context if shorter)")
    b.add_argument("--context", type=positive_int,
                   help="tokens in the cache while decoding (default 1024, or the longest power of two that leaves "
                        "room for --steps in the model's context)")
    b.add_argument("--batches", type=positive_int_list, default=[1, 8], help="decode batch sizes, comma-separated (default 1,8)")
    b.add_argument("--steps", type=positive_int, default=100, help="timed decode steps per batch size (default 100)")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    b.add_argument("--speculate", type=positive_int, metavar="K", help="speculative: draft tokens per step (default 4)")
    b.add_argument("--draft-layers", type=positive_int, metavar="k",
                   help="speculative: layer visits of the draft, an exit point before the last visit (default: the "
                        "deepest exit at or before half of the visits)")
    b.add_argument("--temperature", type=non_negative_float, metavar="T",
                   help="speculative: sampling temperature (default 0: greedy, whose tokens are checked identical "
                        "to plain decoding's)")
    _inference_args(b)
    b.set_defaults(func=cmd_bench)
