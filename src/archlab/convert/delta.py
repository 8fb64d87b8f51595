"""Checkpoint conversions between residual kinds.

``to_delta_mhar`` turns a standard-residual model's weights into a ``delta`` model (spec section
2, "Delta AttnRes"): every baseline tensor is copied unchanged and the new residual parameters
(per-site zero queries, unit gains, zero gates, zero null source) take their identity init, so
the converted model computes exactly the original function until training moves the gates.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from torch import Tensor

from archlab.convert.conversion import build_converted, function_change, open_conversion, save_conversion
from archlab.errors import CheckpointError, ConfigError
from archlab.model.config import ModelConfig
from archlab.model.core.spec import n_visits

RESIDUAL_PREFIX = "residual."


def to_delta_mhar(state_dict: dict[str, Tensor], model_cfg: ModelConfig, heads: int = 4,
                  groups: int = 0) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``(new_cfg, new_state_dict)`` of the delta-MHAR version of a standard-residual model.

    ``heads`` routing heads (must divide ``d_model``), ``groups`` delta groups over the ``2L``
    sublayers (0 = one per transformer layer). The input state dict is not modified; its tensors
    are shared with the output (copy them if you mean to modify both).
    """
    kind = model_cfg.residual.kind
    if kind != "standard":
        raise ConfigError(f"config error: model.residual.kind: delta conversion needs a standard-residual "
                          f"model, this one is {kind!r}")
    stray = sorted(k for k in state_dict if k.startswith(RESIDUAL_PREFIX))
    if stray:
        raise CheckpointError(f"the weights already hold residual parameters ({stray[0]}, ...); "
                              "they do not come from a standard-residual model")
    new_cfg = copy.deepcopy(model_cfg)
    new_cfg.residual = dataclasses.replace(model_cfg.residual, kind="delta", heads=heads,
                                           delta_groups=groups, blocks=0)
    new_cfg.validate()  # heads must divide d_model, groups in 0..2L

    ref = state_dict.get("tok_emb.weight")
    if ref is None:
        raise CheckpointError("the weights have no tok_emb.weight; not an archlab model")
    fresh = _delta_stream(new_cfg)
    new_sd = dict(state_dict)
    for name, value in fresh.state_dict().items():
        new_sd[RESIDUAL_PREFIX + name] = value.to(device=ref.device, dtype=ref.dtype)
    return new_cfg, new_sd


def _delta_stream(cfg: ModelConfig):
    """A freshly initialised delta residual stream of ``cfg`` (its identity init)."""
    from archlab.model.core.spec import layer_specs

    stream = cfg.variant("residual").load()(cfg, layer_specs(cfg))
    stream.init_parameters(cfg.variant("init").load()(cfg))
    return stream


def new_parameter_names(cfg: ModelConfig) -> list[str]:
    """State-dict keys the delta conversion adds for ``cfg`` (a delta config)."""
    return [RESIDUAL_PREFIX + k for k in _delta_stream(cfg).state_dict()]


def convert_checkpoint(ckpt: str | Path, out: str | Path, heads: int = 4, groups: int = 0,
                       overwrite: bool = False) -> dict[str, Any]:
    """Convert a standard-residual checkpoint into a delta-MHAR one at ``out``.

    The converted model is checked before anything is written: its logits on a short token
    sequence must equal the original's exactly. Returns a summary (paths, sizes, the check).
    """
    model, run_cfg, ckpt_dir = open_conversion(ckpt, out, overwrite)
    new_cfg, new_sd = to_delta_mhar(model.state_dict(), run_cfg.model, heads=heads, groups=groups)
    new_model = build_converted(new_cfg, new_sd)
    diff = function_change(model, new_model, run_cfg.model)
    if diff != 0.0:
        raise RuntimeError(f"delta conversion changed the model's function (max |dlogp| = {diff}); "
                           "this is a bug in archlab")
    save_conversion(out, new_model, run_cfg, new_cfg, ckpt_dir, "delta-mhar")
    cfg = run_cfg.model
    added = new_parameter_names(new_cfg)
    return {
        "input": str(ckpt_dir),
        "output": str(out),
        "heads": heads,
        "groups": groups or n_visits(cfg),  # one group per visit (per layer when sequential)
        "new_parameters": sum(new_sd[k].numel() for k in added),
        "new_tensors": len(added),
        "max_abs_logit_diff": diff,
    }


__all__ = ["convert_checkpoint", "new_parameter_names", "to_delta_mhar"]
