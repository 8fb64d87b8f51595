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

from torch import Tensor

from archlab.convert.conversion import build_converted, function_change, open_conversion, save_conversion
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
    model, run_cfg, ckpt_dir = open_conversion(ckpt, out, overwrite)
    new_cfg, new_sd = to_hidden(model.state_dict(), run_cfg.model, streams, mix_layers)
    new_model = build_converted(new_cfg, new_sd)
    diff = function_change(model, new_model, run_cfg.model)
    cfg = run_cfg.model
    mixing = sorted(new_cfg.hidden_decoding.mixing(cfg.n_layers))
    if len(mixing) <= 1 and diff > EXACT_TOLERANCE:
        raise RuntimeError(f"hidden conversion changed the model's function (max |dlogp| = {diff}); "
                           "this is a bug in archlab")
    save_conversion(out, new_model, run_cfg, new_cfg, ckpt_dir, f"hidden-{streams}")
    return {
        "input": str(ckpt_dir),
        "output": str(out),
        "streams": streams,
        "mix_layers": mixing,
        "new_parameters": (streams - 1) * cfg.vocab_size * new_model.base_width,
        "max_abs_logprob_diff": diff,
    }


__all__ = ["EXACT_TOLERANCE", "convert_checkpoint", "to_hidden"]
