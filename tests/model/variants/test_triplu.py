"""TriPLU: the product formula against a float64 reference, the hidden width solved to SwiGLU's
parameters (within 1%) for every degree, the degree and norm options, the init scale and the
``u`` tap the decode branch couples to."""

from __future__ import annotations

import pytest
import torch

from archlab.config import make_config
from archlab.errors import ConfigError
from archlab.model import build_model
from archlab.model.accounting import parts
from archlab.model.config import ModelConfig
from archlab.model.core.context import Context
from archlab.model.core.ffn import SwiGLU
from archlab.model.core.init import NormalInit
from archlab.model.core.spec import layer_specs
from archlab.model.variants.branch.module import RecordPass
from archlab.model.variants.triplu import TriPLUConfig
from archlab.model.variants.triplu.module import TriPLU, solve_hidden



def cfg_of(d: int = 64, **triplu) -> ModelConfig:
    cfg = ModelConfig(vocab_size=97, d_model=d, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                      ffn="triplu", triplu=TriPLUConfig(**triplu))
    return cfg.validate()


def layer(cfg: ModelConfig, dtype=torch.float64, seed: int = 0) -> TriPLU:
    torch.manual_seed(seed)
    m = TriPLU(cfg, layer_specs(cfg)[0])
    m.init_parameters(NormalInit(cfg))
    with torch.no_grad():  # weights large enough that the product is O(1)
        m.w_in.weight.normal_(0.0, 0.3)
        m.w_out.weight.normal_(0.0, 0.3)
        if m.norm_weight is not None:
            m.norm_weight.uniform_(0.5, 1.5)
    return m.to(dtype)


def reference(m: TriPLU, x: torch.Tensor, eps: float) -> torch.Tensor:
    """``W_o N(prod_k W_k x)`` written out in float64, one projection at a time."""
    x = x.double()
    w = m.w_in.weight.double()
    h = m.hidden
    p = torch.ones(*x.shape[:-1], h, dtype=torch.float64)
    for k in range(m.degree):
        p = p * (x @ w[k * h:(k + 1) * h].T)
    if m.norm_weight is not None:
        p = p / torch.sqrt((p * p).mean(-1, keepdim=True) + eps) * m.norm_weight.double()
    return p @ m.w_out.weight.double().T


@pytest.mark.parametrize("degree", [2, 3, 4])
@pytest.mark.parametrize("norm", [True, False])
def test_product_formula_matches_float64_reference(degree, norm):
    cfg = cfg_of(degree=degree, norm=norm)
    m = layer(cfg)
    assert m.w_in.weight.shape == (degree * m.hidden, 64)
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    out = m(x, Context(rope=None))
    torch.testing.assert_close(out, reference(m, x, cfg.norm_eps), rtol=1e-12, atol=1e-12)
    # float32 agrees to float32 rounding
    m32 = m.float()
    torch.testing.assert_close(m32(x.float(), Context(rope=None)).double(), reference(m, x, cfg.norm_eps),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("d", [64, 96, 128, 256, 384, 768, 1024, 2048])
@pytest.mark.parametrize("degree", [2, 3, 4])
@pytest.mark.parametrize("norm", [True, False])
def test_parameters_match_swiglu_within_one_percent(d, degree, norm):
    cfg = cfg_of(d, degree=degree, norm=norm)
    spec = layer_specs(cfg)[0]
    swiglu = SwiGLU.cost(cfg, spec).params
    ours = TriPLU.cost(cfg, spec).params
    assert abs(ours - swiglu) <= 0.01 * swiglu
    ffn_parts = [p.cost.params for p in parts(cfg) if p.name.endswith(".ffn")]
    assert ffn_parts == [ours] * cfg.n_layers
    h = solve_hidden(cfg, spec)
    assert ours == (degree + 1) * d * h + (h if norm else 0)


def test_hidden_widths_and_their_multiples():
    # d=768 (SwiGLU hidden 2048): degree 3 -> 3/4 * 2048 = 1536, a multiple of 64 (the norm's
    # 1536 gains are within the tolerance); degree 4 -> 1232 (multiple of 16); degree 2 -> 2048
    assert [solve_hidden(c, layer_specs(c)[0]) for c in (cfg_of(768, degree=k) for k in (2, 3, 4))] == [2048, 1536, 1232]
    # d=64 (SwiGLU hidden 192)
    assert [solve_hidden(c, layer_specs(c)[0]) for c in (cfg_of(64, degree=k) for k in (2, 3, 4))] == [192, 144, 114]
    # explicit multiple and explicit hidden
    c = cfg_of(768, degree=4, multiple_of=64)
    assert solve_hidden(c, layer_specs(c)[0]) == 1216
    c = cfg_of(64, hidden=100)
    assert solve_hidden(c, layer_specs(c)[0]) == 100 and layer(c).w_out.weight.shape == (64, 100)


def test_built_model_is_counted_and_degree_changes_the_module():
    for degree in (2, 3, 4):
        cfg = cfg_of(degree=degree)
        model = build_model(cfg)
        assert all(isinstance(b.mlp, TriPLU) and b.mlp.degree == degree for b in model.layers)
        assert sum(p.numel() for p in model.parameters()) == sum(p.cost.params for p in parts(cfg))


def test_init_scale_shrinks_the_input_projections():
    torch.manual_seed(0)
    cfg = cfg_of(256, init_scale=0.5)
    m = build_model(cfg).layers[0].mlp
    assert abs(m.w_in.weight.std().item() / (0.5 * cfg.init_std) - 1) < 0.02
    assert abs(m.w_out.weight.std().item() / (cfg.init_std / 2) - 1) < 0.05  # out: init_std / sqrt(2L)
    assert torch.equal(m.norm_weight, torch.ones_like(m.norm_weight))


def test_u_tap_is_the_normalised_product_with_coupling_width_hidden():
    cfg = cfg_of()
    m = layer(cfg)
    rec = RecordPass()
    x = torch.randn(2, 3, 64, dtype=torch.float64)
    m(x, Context(rope=None, rows=rec))
    u = rec.values[(0, "u")]
    assert u.shape[-1] == m.hidden == TriPLU.coupling_width(cfg, layer_specs(cfg)[0])
    torch.testing.assert_close(u @ m.w_out.weight.T, reference(m, x, cfg.norm_eps), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(u, m.product(x))
    # the decode branch sizes its hidden coupling vector b to it
    c2 = cfg_of()
    c2.branch.enabled = True
    model = build_model(c2)
    assert model.layers[0].couple_u.a.shape == (1, m.hidden)


def test_bf16_autocast_runs_the_norm_in_fp32():
    cfg = cfg_of()
    m = layer(cfg, dtype=torch.float32)
    x = torch.randn(2, 3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x, Context(rope=None))
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), m(x, Context(rope=None)), rtol=0.1, atol=0.1)


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match=r"model.triplu.degree: expected one of 2, 3, 4"):
        make_config("tiny", overrides=["model.ffn=triplu", "model.triplu.degree=5"])
    with pytest.raises(ConfigError, match=r"model.triplu.init_scale: must be positive"):
        make_config("tiny", overrides=["model.ffn=triplu", "model.triplu.init_scale=0"])
