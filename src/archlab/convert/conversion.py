"""What every checkpoint conversion does around its own tensor mapping: open the input and refuse
an output that would overwrite it, build the converted model, measure how far its function moved
on a fixed probe, and save it with its provenance. ``delta`` and ``hidden`` differ only in the
mapping and in how far the function may move."""

from __future__ import annotations

import dataclasses
from pathlib import Path
import torch

from archlab.errors import CheckpointError
from archlab.model.config import ModelConfig


def open_conversion(ckpt: str | Path, out: str | Path, overwrite: bool):
    """(model in eval mode, its run config, its checkpoint directory) of ``ckpt``, after refusing
    an ``out`` that is the input or already exists (without ``overwrite``)."""
    from archlab.io.checkpoint import load_model

    out = Path(out)
    model, run_cfg, ckpt_dir = load_model(ckpt)
    if out.resolve() == ckpt_dir.resolve():
        raise CheckpointError(f"--out {out} is the input checkpoint; write the conversion elsewhere")
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists; pass --overwrite to replace it")
    return model.eval(), run_cfg, ckpt_dir


def build_converted(cfg: ModelConfig, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The converted model, every tensor given (strict), in eval mode."""
    from archlab.model import build_model

    model = build_model(cfg).eval()
    model.load_state_dict(state_dict, strict=True)
    return model


def function_change(original: torch.nn.Module, converted: torch.nn.Module, cfg: ModelConfig) -> float:
    """The largest |log-probability| difference of the two models on a fixed probe: two rows of up
    to 32 tokens spread over the vocabulary."""
    n = min(32, cfg.max_seq_len)
    idx = (torch.arange(2 * n).view(2, n) * 7919 % cfg.vocab_size).long()
    with torch.no_grad():
        a, b = original(idx), converted(idx)
        return float((original.log_probs(a) - converted.log_probs(b)).abs().max())


def save_conversion(out: str | Path, model: torch.nn.Module, run_cfg, new_cfg: ModelConfig, ckpt_dir: Path,
                    conversion: str) -> None:
    """``model`` as a weights-only checkpoint at ``out``, with the input's tokenizer and a record
    of where it came from (``converted_from``, ``conversion``)."""
    from archlab.io.checkpoint import save_model

    tokenizer = ckpt_dir / "tokenizer.json"
    save_model(Path(out), model, dataclasses.replace(run_cfg, model=new_cfg),
               tokenizer_path=tokenizer if tokenizer.is_file() else None,
               extra_state={"converted_from": str(ckpt_dir), "conversion": conversion})

