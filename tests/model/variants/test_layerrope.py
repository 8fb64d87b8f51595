"""LayerRoPE: the rotated gain against an explicit complex128 multiplication, the four sites per
layer (normalising inputs, plain-gain outputs), the final norm choice, one shared fp32 parameter
(registered once, seen by every site, fp32 under bf16 autocast and after a bf16 cast), learnable
scalars and the accounting."""

from __future__ import annotations

import math

import pytest
import torch

from archlab.config import make_config
from archlab.model import build_model
from archlab.model.accounting import param_counts
from archlab.model.config import ModelConfig
from archlab.model.core.layers import RMSNorm
from archlab.model.variants.layerrope import LayerRopeConfig
from archlab.model.variants.layerrope.module import SITE_SETS, LayerRopeNorms, RotatedGain

D = 64



def cfg_of(n_layers: int = 3, **opts) -> ModelConfig:
    cfg = ModelConfig(vocab_size=97, d_model=D, n_layers=n_layers, n_heads=4, n_kv_heads=2, max_seq_len=64,
                      norm="layerrope", layerrope=LayerRopeConfig(**opts))
    return cfg.validate()


def complex_reference(g: torch.Tensor, layer: int, a: float, b: float, a_rot: float, b_rot: float,
                      base: float) -> torch.Tensor:
    """(g_2j + i g_2j+1) * exp(r + i theta_j) in complex128, back to interleaved reals."""
    d = g.numel()
    u = math.log(layer + 1)
    j = torch.arange(d // 2, dtype=torch.float64)
    theta = math.exp(a_rot + b_rot * u) * base ** (-2 * j / d)
    r = torch.full_like(theta, a + b * u)
    z = torch.view_as_complex(g.detach().double().reshape(-1, 2).contiguous()) * torch.exp(torch.complex(r, theta))
    assert z.dtype == torch.complex128
    return torch.view_as_real(z).flatten()


@pytest.mark.parametrize("opts", [dict(), dict(a=0.3, b=-0.7, a_rot=-1.0, b_rot=0.25, base=1000.0)])
def test_rotation_equals_complex_multiplication(opts):
    cfg = cfg_of(**opts)
    norms = LayerRopeNorms(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        norms.g.normal_()
    o = cfg.layerrope
    for layer in range(cfg.n_layers + 1):
        got = norms.gain(layer, "attn_in")
        assert got.dtype == torch.float32 and got.shape == (D,)
        want = complex_reference(norms.g, layer, o.a, o.b, o.a_rot, o.b_rot, o.base)
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)
    # at init (g = 1, defaults): magnitude 1/sqrt(l+1) per pair, layer 0 rotated by theta_j = 100^(-2j/d)
    fresh = LayerRopeNorms(cfg_of())
    mag = fresh.gain(3, "mlp_in").double().reshape(-1, 2).norm(dim=-1)
    torch.testing.assert_close(mag, torch.full_like(mag, math.sqrt(2) / 2), rtol=1e-6, atol=1e-6)


def test_learnable_per_site_scalars_match_the_reference_and_get_gradients():
    cfg = cfg_of(learnable=True, per_site=True)
    norms = LayerRopeNorms(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in norms.parameters():
            p.normal_(0.0, 0.5)
    for k, site in enumerate(SITE_SETS):
        a, b, ar, br = (getattr(norms, n)[k].item() for n in ("a", "b", "a_rot", "b_rot"))
        for layer in (0, 2):
            want = complex_reference(norms.g, layer, a, b, ar, br, 100.0)
            torch.testing.assert_close(norms.gain(layer, site).double(), want, rtol=2e-6, atol=2e-6)
    norms.gain(2, "mlp_out").sum().backward()
    assert all(getattr(norms, n).grad[3] != 0 for n in ("a", "b", "a_rot", "b_rot"))
    assert all(getattr(norms, n).grad[0] == 0 for n in ("a", "b", "a_rot", "b_rot"))  # other sites' sets
    # every scalar is a 1-D parameter (no weight decay in the trainer's rule)
    assert {n: p.shape for n, p in norms.named_parameters()} == {
        "g": (D,), "a": (5,), "b": (5,), "a_rot": (5,), "b_rot": (5,)}


def test_one_shared_parameter_registered_once():
    cfg = cfg_of()
    model = build_model(cfg)
    names = [n for n, p in model.named_parameters() if p is model.norms.g]
    assert names == ["norms.g"]
    assert [k for k in model.state_dict() if k.startswith("norms.")] == ["norms.g"]
    assert [k for k in model.state_dict() if k.startswith("layers.") and "norm" in k] == []
    sites = [m for m in model.modules() if isinstance(m, RotatedGain)]
    assert len(sites) == 4 * cfg.n_layers  # attn_in, attn_out, mlp_in, mlp_out per layer
    assert all(not list(s.parameters()) and not s.state_dict() and s.owner is model.norms for s in sites)
    # no per-layer gain anywhere: the only other norm parameter is the final RMSNorm's (default)
    assert isinstance(model.norm, RMSNorm)
    per_layer = [n for n, _ in model.named_parameters() if n.startswith("layers.") and "norm" in n]
    assert per_layer == []
    assert param_counts(cfg)["params_total"] == sum(p.numel() for p in model.parameters())
    # one update of g moves every site
    x = torch.randn(2, 3, D)
    before = [s(x) for s in sites]
    with torch.no_grad():
        model.norms.g.mul_(2.0)
    for s, y in zip(sites, before):
        torch.testing.assert_close(s(x), 2 * y)


def test_sites_normalise_inputs_and_scale_outputs():
    cfg = cfg_of()
    model = build_model(cfg)
    with torch.no_grad():
        model.norms.g.normal_()
    block = model.layers[2]
    x = torch.randn(2, 5, D) * 3.0
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    gain = model.norms.gain(2, "attn_in")
    torch.testing.assert_close(block.attn_norm(x), rms * gain)
    torch.testing.assert_close(block.mlp_norm(x), rms * gain)
    torch.testing.assert_close(block.attn_out_norm(x), x * gain)  # not normalised
    torch.testing.assert_close(block.mlp_out_norm(x), x * gain)
    # the rotated final norm (option) uses depth l = n_layers
    rot = build_model(cfg_of(final="rotated"))
    assert isinstance(rot.norm, RotatedGain) and rot.norm.layer == cfg.n_layers
    assert param_counts(cfg_of(final="rotated"))["params_total"] == sum(p.numel() for p in rot.parameters())
    # out sites can be switched off
    off = build_model(cfg_of(out_sites=False))
    assert off.layers[0].attn_out_norm is None and off.layers[0].mlp_out_norm is None


def test_gains_are_fp32_under_bf16_autocast_and_after_a_bf16_cast():
    cfg = cfg_of()
    torch.manual_seed(0)
    model = build_model(cfg)
    idx = torch.randint(0, 97, (2, 8))
    seen = []
    hook = model.layers[1].attn_norm.register_forward_hook(
        lambda m, i, o: seen.append(m.owner.gain(m.layer, m.site_name).dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(idx, idx)
        gain = model.norms.gain(1, "attn_in")
    hook.remove()
    assert gain.dtype == torch.float32 and seen == [torch.float32] and model.norms.g.dtype == torch.float32
    assert torch.isfinite(out.loss)
    # a site's bf16 output is the fp32 computation rounded once
    x = torch.randn(2, 3, D, dtype=torch.bfloat16)
    site = model.layers[1].attn_norm
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * gain
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(site(x), ref.to(torch.bfloat16))
    model.to(torch.bfloat16)
    assert model.norms.g.dtype == torch.float32 and model.lm_head.weight.dtype == torch.bfloat16
    assert torch.isfinite(model(idx).logits.float()).all()


def test_accounting_puts_the_shared_gain_in_the_final_norm():
    from archlab.model.accounting import parts

    cfg = cfg_of(learnable=True)
    ps = {p.name: p.cost.params for p in parts(cfg)}
    assert all(ps[f"L{l}.norms"] == 0 for l in range(cfg.n_layers))
    assert ps["final_norm"] == D + 4 * 5 + D  # shared g + 4 scalars x 5 site sets + final RMSNorm gain
    model = build_model(cfg)
    assert param_counts(cfg)["params_total"] == sum(p.numel() for p in model.parameters())


def test_odd_width_is_a_config_error():
    from archlab.errors import ConfigError

    with pytest.raises(ConfigError, match="model.d_model: layerrope pairs gain entries"):
        make_config("tiny", overrides=["model.norm=layerrope", "model.d_model=63", "model.n_heads=7",
                                       "model.n_kv_heads=7", "model.head_dim=10"])
