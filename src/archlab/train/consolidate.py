"""``archlab checkpoint consolidate``: a distributed run's sharded (DCP) checkpoint as one
safetensors checkpoint, written by one process without a process group.

It lives in ``train`` because it rebuilds the trainer's optimizer to read the AdamW moments;
``archlab.io.dcp`` (below ``train``) only reads and writes the shards.
"""

from __future__ import annotations

from pathlib import Path

import torch

from archlab.config import config_from_dict
from archlab.errors import CheckpointError
from archlab.io import checkpoint as ckpt_io
from archlab.io import dcp as dcp_io
from archlab.model import build_model
from archlab.train.trainer import make_optimizer, optimizer_tensors


def consolidate(src: str | Path, out: str | Path) -> Path:
    """A sharded checkpoint as a one-process checkpoint (safetensors): one process, no group.

    The result is a complete checkpoint: eval, generate and serve read its weights, and a
    one-process ``archlab train`` resumes from it (same config, same ``--out`` layout)."""
    ckpt = ckpt_io.resolve_checkpoint(src)
    state = ckpt_io.read_state(ckpt)
    if not dcp_io.is_sharded(state):
        raise CheckpointError(f"{ckpt} is already a one-process checkpoint (safetensors); nothing to consolidate")
    cfg = config_from_dict(state["config"])
    model = build_model(cfg.model)
    opt = make_optimizer(model, cfg.train, torch.device("cpu"))
    rng = dcp_io.load(ckpt, state, model, opt, rank=0)
    otensors, ometa = optimizer_tensors(opt)
    otensors.update(rng)
    keep = {k: v for k, v in state.items()
            if k not in ("format", "world_size", "dcp_files", "files", "format_version", "optimizer")}
    extra = {"tokenizer.json": ckpt / "tokenizer.json"} if (ckpt / "tokenizer.json").is_file() else None
    return ckpt_io.write_checkpoint(Path(out), {"model": ckpt_io.model_tensors(model), "optim": otensors},
                                    {**keep, "optimizer": ometa}, extra)


__all__ = ["consolidate"]
