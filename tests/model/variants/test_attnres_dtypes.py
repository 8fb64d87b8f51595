"""Where the depth sources live: ``residual.source_dtype`` and ``residual.grad_dtype``."""

from __future__ import annotations

import pytest
import torch

from archlab.errors import ConfigError
from archlab.model import build_model
from archlab.model.variants.attnres import ResidualConfig
from archlab.model.variants.attnres.module import DepthRouting
from tests.helpers import tiny_model_cfg


def _source_dtypes(model, idx: torch.Tensor, autocast: bool) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    original = DepthRouting._new_state

    def spy(self, x0, first, ctx):
        state = original(self, x0, first, ctx)
        seen.append(state.dtype)
        return state

    DepthRouting._new_state = spy
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(idx, targets=idx).loss.backward()
    finally:
        DepthRouting._new_state = original
    return seen


@pytest.mark.parametrize("kind", ["attnres", "delta"])
@pytest.mark.parametrize("source_dtype,autocast,expected", [
    ("auto", False, torch.float32),  # no autocast: the embedding's dtype
    ("auto", True, torch.bfloat16),  # autocast: its dtype
    ("float32", True, torch.float32),
    ("bfloat16", False, torch.bfloat16),
])
def test_source_dtype(kind, source_dtype, autocast, expected):
    torch.manual_seed(0)
    cfg = tiny_model_cfg(residual=ResidualConfig(kind=kind, heads=2, impl="compile", source_dtype=source_dtype))
    model = build_model(cfg)
    model.residual.buffered = True
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    assert _source_dtypes(model, idx, autocast) == [expected]
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_grad_dtype_from_config():
    for name, dtype in (("auto", None), ("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = build_model(tiny_model_cfg(residual=ResidualConfig(kind="attnres", grad_dtype=name)))
        assert model.residual.grad_dtype == dtype


def test_unknown_dtype_is_a_config_error():
    from archlab.config import make_config

    with pytest.raises(ConfigError, match="source_dtype"):
        make_config("tiny", overrides=["model.residual.kind=attnres", "model.residual.source_dtype=float16"])
