"""Command line of inference: ``generate``."""

from __future__ import annotations

import argparse

from archlab.errors import CheckpointError, UsageError


def cmd_generate(args) -> int:
    import torch

    from archlab.data.tokenizer import load_tokenizer
    from archlab.infer.generate import Generator, Sampling
    from archlab.io.checkpoint import load_model
    from archlab.io.device import resolve_device

    model, cfg, ckpt = load_model(args.ckpt, resolve_device(args.device))
    if args.max_new_tokens >= cfg.model.max_seq_len:
        raise UsageError(f"--max-new-tokens must be below the model's context of {cfg.model.max_seq_len} "
                           f"tokens (room is needed for the prompt), got {args.max_new_tokens}")
    tok_path = ckpt / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no tokenizer.json; cannot encode prompts")
    tok = load_tokenizer(tok_path)
    prompts = [tok.encode(p).ids or [0] for p in args.prompt]
    stops = tuple(tok.encode(s).ids[0] for s in args.stop if tok.encode(s).ids) + (0,)
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, stop_tokens=stops, seed=args.seed)
    room = cfg.model.max_seq_len - sampling.max_new_tokens
    prompts = [p[-room:] for p in prompts]
    with torch.no_grad():
        outs = Generator(model).generate(prompts, sampling)
    for text, out in zip(args.prompt, outs):
        out = [t for t in out if t != 0]
        print(text + tok.decode(out))
        if len(args.prompt) > 1:
            print("-" * 40)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="sample continuations from a checkpoint")
    g.add_argument("--ckpt", required=True)
    g.add_argument("--prompt", action="append", required=True, help="repeatable: one batch row each")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--stop", action="append", default=[], help="stop at this text's first token")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto")
    g.set_defaults(func=cmd_generate)
