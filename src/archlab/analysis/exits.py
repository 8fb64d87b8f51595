"""The validation loss at every early exit (``archlab probe exits``).

One run over the layers per validation batch: after each layer visit, the state an exit there
would read out goes through the shared final norm and head (``Transformer.run``'s ``on_exit``),
and its loss is added up. The windows are ``archlab eval``'s (the same defaults), so the last row
is the model's own validation loss and row ``L`` is ``archlab eval --exit-layer L``'s. A decode-
branch model is read out by its primary rows alone here (their softmax, not the mixture).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.table import Table
from torch import nn

from archlab.errors import UsageError
from archlab.model import registry
from archlab.model.core.context import Context


@torch.no_grad()
def exit_losses(model: nn.Module, data: Any, n_batches: int, batch_size: int, seq_len: int,
                device: torch.device | str = "cpu") -> dict[str, Any]:
    """Per exit (``model.exit_points``: layer visits run before reading out) the mean loss in
    nats per token and bits per byte over the validation windows of ``data`` (a ``TokenData``)."""
    was_training = model.training
    model.eval()
    nats = {n: 0.0 for n in model.exit_points}
    tokens = n_bytes = 0
    try:
        for x, y in data.val_batches(n_batches, batch_size, seq_len):
            x, y = x.to(device), y.to(device)

            def score(visit: int, hidden: torch.Tensor) -> None:
                logits = model.logits(hidden).float()
                nats[visit + 1] += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))

            model.run(model.tok_emb(x), Context(rope=model.position.tables(x.shape[1])), on_exit=score)
            tokens += y.numel()
            n_bytes += data.target_bytes(y)
    finally:
        model.train(was_training)
    rows = [{"exit": n, "layer": model.visits[n - 1], "loss": nats[n] / tokens,
             "bpb": nats[n] / math.log(2) / n_bytes} for n in model.exit_points]
    return {"exits": rows, "tokens": tokens, "bytes": n_bytes, "visits": len(model.visits)}


def probe_exits(ckpt: str | Path, data: str | Path | None = None, n_batches: int = 16, batch_size: int = 8,
                seq_len: int | None = None, device: str = "auto") -> dict[str, Any]:
    """``exit_losses`` of a checkpoint on the validation split of ``data`` (None: the data it was
    trained on, as ``archlab eval``), with the checkpoint and data named."""
    from archlab.data.loader import TokenData
    from archlab.eval.corpus import check_same_tokenizer
    from archlab.io.checkpoint import load_model
    from archlab.io.device import resolve_device

    dev = resolve_device(device)
    model, cfg, ckpt_dir = load_model(ckpt, dev)
    seq = seq_len or cfg.train.seq_len
    if seq > cfg.model.max_seq_len:
        raise UsageError(f"--seq-len must be at most the model's context of {cfg.model.max_seq_len} tokens, "
                         f"got {seq}")
    tokens = TokenData(data if data is not None else cfg.data.path)
    tokens.check_model_vocab(cfg.model.vocab_size)
    check_same_tokenizer(ckpt_dir, tokens)
    out = exit_losses(model, tokens, n_batches, batch_size, seq, dev)
    return {**out, "checkpoint": str(ckpt_dir), "data": str(tokens.path), "followers": registry.followers(cfg.model)}


def exits_table(result: dict[str, Any]) -> Table:
    """One row per exit: the visits run, the layer it ends on, loss, bits per byte, and the loss
    above the last exit's (the full model's)."""
    full = result["exits"][-1]["loss"]
    who = " (primary rows)" if result["followers"] else ""
    table = Table(title=f"validation loss at every exit{who}: {result['checkpoint']} on {result['data']}, "
                        f"{result['tokens']:,} tokens")
    for col in ("exit after", "layer", "loss (nats/token)", "bits/byte", "vs full"):
        table.add_column(col, justify="right")
    for r in result["exits"]:
        table.add_row(f"{r['exit']}/{result['visits']}", str(r["layer"]), f"{r['loss']:.4f}", f"{r['bpb']:.4f}",
                      f"{r['loss'] - full:+.4f}")
    return table
