"""A checkpoint ready for inference: the model on its device and dtype, and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from archlab.errors import CheckpointError, UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA (decoding reads every weight each step: half the bytes), fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UsageError(f"--dtype must be auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def load_for_inference(ckpt: str | Path, device: str = "auto", dtype: str = "auto"):
    """(model in eval mode, tokenizer, end-of-text id or None, a name for the model)."""
    from archlab.data.tokenizer import EOS_TOKEN, load_tokenizer
    from archlab.io.checkpoint import load_model
    from archlab.io.device import resolve_device

    dev = resolve_device(device)
    model, cfg, path = load_model(ckpt, dev)
    model = model.to(resolve_dtype(dtype, dev)).eval()
    tok_path = path / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no tokenizer.json; cannot encode prompts")
    tokenizer = load_tokenizer(tok_path)
    name = path.parent.parent.name if path.parent.name == "ckpt" else path.name
    return model, tokenizer, tokenizer.token_to_id(EOS_TOKEN), name
