"""Checkpoint conversion to Hidden Decoding (spec section 3): the paper's continued pretraining.

``to_hidden`` turns a one-row model into a Hidden Decoding model of ``streams`` streams: every
tensor is copied unchanged and each hidden stream's embedding table starts as a copy of the
token embedding. The scored stream keeps reading the token embedding, so before the first mixing
layer every stream of a token holds the same state; in a mixing layer the scored stream then sees
each earlier key/value ``n`` times at one position, which leaves its softmax unchanged. With at
most one mixing layer (the default, the middle layer) the converted model therefore computes the
original function up to float rounding; every later mixing layer reads hidden streams that the
first one made differ (they saw fewer copies of their own token), so more mixing layers start
near the original, not at it (``convert_checkpoint`` measures and reports the difference).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from archlab.errors import CheckpointError, ConfigError
from archlab.model import registry
from archlab.model.config import ModelConfig

#: the largest |log-probability| difference a converted model may show against the original
#: when it has at most one mixing layer: the function is the same, and float32 rounding of the
#: duplicated keys' softmax and of a differently shaped attention call stays far below this
EXACT_TOLERANCE = 1e-4


def to_hidden(state_dict: dict[str, Tensor], model_cfg: ModelConfig, streams: int,
              mix_layers: list[int] | None = None) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``(new_cfg, new_state_dict)`` of the Hidden Decoding version of a one-row model. The input
    state dict is not modified; its tensors are shared with the output."""
    rows = registry.lookup(model_cfg, "rows")
    if rows.kind != registry.SLOTS["rows"].default:
        raise ConfigError(f"config error: model.{rows.section_name}: hidden conversion needs a model of one "
                          f"row per token, this one has the rows kind {rows.kind!r}")
    new_cfg = copy.deepcopy(model_cfg)
    new_cfg.hidden_decoding = dataclasses.replace(model_cfg.hidden_decoding, enabled=True, streams=streams,
                                                  mix_layers=mix_layers)
    new_cfg.validate()  # streams in range, mixing layers real layers
    table = state_dict.get("tok_emb.weight")
    if table is None:
        raise CheckpointError("the weights have no tok_emb.weight; not an archlab model")
    if "stream_emb.weight" in state_dict:
        raise CheckpointError("the weights already hold stream_emb.weight; they come from a Hidden Decoding model")
    new_sd = dict(state_dict)
    if streams > 1:
        new_sd["stream_emb.weight"] = table.repeat(streams - 1, 1)  # stream s: rows s*V .. (s+1)*V - 1
    return new_cfg, new_sd


def convert_checkpoint(ckpt: str | Path, out: str | Path, streams: int, mix_layers: list[int] | None = None,
                       overwrite: bool = False) -> dict[str, Any]:
    """Convert a one-row checkpoint into a Hidden Decoding one at ``out``.

    Before anything is written, the converted model's log-probabilities on a short token sequence
    are compared with the original's: within ``EXACT_TOLERANCE`` when it has at most one mixing
    layer (else this is a bug), and reported either way. Returns a summary."""
    from archlab.io.checkpoint import load_model, save_model
    from archlab.model import build_model

    out = Path(out)
    model, run_cfg, ckpt_dir = load_model(ckpt)
    if out.resolve() == ckpt_dir.resolve():
        raise CheckpointError(f"--out {out} is the input checkpoint; write the conversion elsewhere")
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists; pass --overwrite to replace it")
    model.eval()
    new_cfg, new_sd = to_hidden(model.state_dict(), run_cfg.model, streams, mix_layers)
    new_model = build_model(new_cfg).eval()
    new_model.load_state_dict(new_sd, strict=True)

    cfg = run_cfg.model
    n = min(32, cfg.max_seq_len)
    idx = (torch.arange(2 * n).view(2, n) * 7919 % cfg.vocab_size).long()
    with torch.no_grad():
        diff = float((model.log_probs(model(idx)) - new_model.log_probs(new_model(idx))).abs().max())
    mixing = sorted(new_cfg.hidden_decoding.mixing(cfg.n_layers))
    if len(mixing) <= 1 and diff > EXACT_TOLERANCE:
        raise RuntimeError(f"hidden conversion changed the model's function (max |dlogp| = {diff}); "
                           "this is a bug in archlab")

    save_model(out, new_model, dataclasses.replace(run_cfg, model=new_cfg),
               tokenizer_path=ckpt_dir / "tokenizer.json" if (ckpt_dir / "tokenizer.json").is_file() else None,
               extra_state={"converted_from": str(ckpt_dir), "conversion": f"hidden-{streams}"})
    return {
        "input": str(ckpt_dir),
        "output": str(out),
        "streams": streams,
        "mix_layers": mixing,
        "new_parameters": (streams - 1) * cfg.vocab_size * new_model.base_width,
        "max_abs_logprob_diff": diff,
    }


__all__ = ["EXACT_TOLERANCE", "convert_checkpoint", "to_hidden"]
