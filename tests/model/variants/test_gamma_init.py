"""gamma-init: every drawn weight of a built model has std fan_in^-gamma (within sampling error),
whatever its role; every matrix of the model is drawn; the fan-in each component states is its
input width (d_model for the embedding table)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from archlab.config import make_config
from archlab.errors import ConfigError
from archlab.model import build_model
from archlab.model.core.init import Init
from archlab.model.variants.gamma_init.module import GammaInit

ZOO = Path(__file__).resolve().parents[3] / "configs" / "zoo"
BASE = ["model.vocab_size=97", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.max_seq_len=64", "train.seq_len=32", "model.init=gamma"]



class Recorder(Init):
    """Draws through ``inner`` and keeps (tensor, fan_in, role) of every draw."""

    def __init__(self, inner: Init) -> None:
        self.inner, self.calls = inner, []

    def weight(self, w, fan_in, role) -> None:
        self.inner.weight(w, fan_in, role)
        self.calls.append((w, fan_in, role))


def drawn(*overrides: str, seed: int = 0):
    cfg = make_config("tiny", overrides=[*BASE, *overrides]).model
    torch.manual_seed(seed)
    model = build_model(cfg)
    rec = Recorder(model.init_scheme)
    model.init_scheme = rec
    model.reset_parameters()
    return cfg, model, rec.calls


@pytest.mark.parametrize("gamma", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("extra", [
    [],
    ["model.ffn=moe", "model.moe.shared_expert=true", "model.branch.enabled=true"],
    ["model.ffn=triplu", "model.triplu.init_scale=1.0", "model.tie_embeddings=true"],
    ["model.residual.kind=attnres", "model.residual.heads=4", "model.heads=prism", "model.prism.head_dims=[32,16]"],
], ids=["baseline", "moe+branch", "triplu+tied", "attnres+prism"])
def test_every_weight_has_std_fan_in_to_the_minus_gamma(gamma, extra):
    cfg, model, calls = drawn(f"model.gamma_init.gamma={gamma}", *extra)
    assert isinstance(model.init_scheme.inner, GammaInit)
    final = {}  # tied tables are drawn twice; the last draw is the value
    for w, fan_in, role in calls:
        final[id(w)] = (w, fan_in, role)
    # every parameter is drawn through the init kind, or is a constant its component sets (norm
    # gains 1; AttnRes queries and decode-branch coupling vectors 0, which are [branches, dim])
    for name, p in model.named_parameters():
        if id(p) not in final:
            assert torch.all(p == 1) or torch.all(p == 0), name
    assert all(id(p) in final for n, p in model.named_parameters() if p.dim() >= 2 and ".couple_" not in n)
    for w, fan_in, role in final.values():
        # the fan-in a component states is its input width: [out, in] matrices and [V, d] tables
        # read the last axis, 3-D expert tensors [E, in, out] the middle one
        assert fan_in == (w.shape[-1] if w.dim() == 2 else w.shape[1]), role
        if role == "embedding":
            assert fan_in == cfg.d_model
        want = fan_in ** -gamma
        n = w.numel()
        std = w.detach().double().std().item()
        assert abs(std / want - 1) < 5 / math.sqrt(2 * n), (role, tuple(w.shape), std, want)
        assert abs(w.detach().double().mean().item()) < 5 * want / math.sqrt(n)


def test_no_depth_factor_on_output_projections():
    cfg, model, calls = drawn("model.gamma_init.gamma=1.0", "model.n_layers=4", seed=1)
    wo = model.layers[3].attn.wo.weight  # role out, fan_in q_dim = 64
    assert abs(wo.std().item() * 64 - 1) < 0.05


def test_yaml_sets_the_companion_eps_and_gamma():
    cfg = make_config("tiny", files=[ZOO / "gamma_init.yaml"])
    assert cfg.model.init == "gamma" and cfg.model.gamma_init.gamma == 1.0 and cfg.model.norm_eps == 1e-12
    control = make_config("tiny", files=[ZOO / "gamma_init.yaml", ZOO / "gamma_init_half.yaml"])
    assert control.model.gamma_init.gamma == 0.5 and control.model.norm_eps == 1e-12


def test_negative_gamma_is_a_config_error():
    with pytest.raises(ConfigError, match="model.gamma_init.gamma: must be >= 0"):
        make_config("tiny", overrides=["model.init=gamma", "model.gamma_init.gamma=-1"])
