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
    from archlab.data.tokenizer import load_tokenizer
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
    return model, tokenizer, special_tokens(path, tokenizer)["eos_token_id"], name


#: the chat template of an imported model, beside tokenizer.json in the checkpoint directory
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def special_tokens(ckpt_dir: Path, tokenizer) -> dict:
    """``eos_token``/``bos_token`` (strings or None) and their ids in ``tokenizer`` of checkpoint
    ``ckpt_dir``: those ``state.json`` records under ``special_tokens`` (``import-hf`` keeps the
    source model's: SmolLM2-Instruct's end of turn is ``<|im_end|>``, not ``<|endoftext|>``), else
    archlab's own ``<|endoftext|>`` as eos when the tokenizer has it, and no bos (archlab trains
    without one). Strings, not ids, are recorded: the ids are the tokenizer's, found here."""
    import json

    from archlab.data.tokenizer import EOS_TOKEN

    try:
        recorded = json.loads((ckpt_dir / "state.json").read_text()).get("special_tokens") or {}
    except (OSError, ValueError, AttributeError):
        recorded = {}
    eos = recorded.get("eos_token") or EOS_TOKEN
    bos = recorded.get("bos_token")
    eos_id = tokenizer.token_to_id(eos)
    bos_id = tokenizer.token_to_id(bos) if bos is not None else None
    return {"eos_token": eos if eos_id is not None else None, "eos_token_id": eos_id,
            "bos_token": bos if bos_id is not None else None, "bos_token_id": bos_id}


def chat_template(ckpt_dir: Path) -> str | None:
    """The chat template ``import-hf`` kept with checkpoint ``ckpt_dir`` (``CHAT_TEMPLATE_FILE``),
    or None when the model has none."""
    f = Path(ckpt_dir) / CHAT_TEMPLATE_FILE
    return f.read_text(encoding="utf-8") if f.is_file() else None
