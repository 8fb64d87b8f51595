"""Prism heads: the depth schedule (rule and explicit list), monotone head counts with power-of-two
head dims, the GQA group kept per layer, and parameters / FLOPs / KV bytes equal to the baseline's
in the accounting and in the built model."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from archlab.config import make_config
from archlab.errors import ConfigError
from archlab.model import build_model
from archlab.model.accounting import costs, per_layer
from archlab.model.config import ModelConfig
from archlab.model.core.spec import layer_specs
from archlab.model.variants.prism import PrismConfig
from archlab.model.variants.prism.module import head_dim_cap, stage_of
from tests.infer.test_generate import assert_matches_full_forward



def cfg_of(prism: PrismConfig | None = None, **over) -> ModelConfig:
    base = dict(vocab_size=97, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64)
    base.update(over)
    if prism is not None:
        base.update(heads="prism", prism=prism)
    cfg = ModelConfig(**base)
    return cfg.validate()


def shape(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    return [(s.n_heads, s.n_kv_heads, s.head_dim) for s in layer_specs(cfg)]


def test_default_rule_is_three_equal_thirds_256_128_64():
    # 124m-like width with GQA group 3: q_dim 768, cap = 2-adic part of 768/3 = 256
    cfg = cfg_of(PrismConfig(), d_model=768, n_heads=12, n_kv_heads=4, n_layers=12)
    assert shape(cfg) == [(3, 1, 256)] * 4 + [(6, 2, 128)] * 4 + [(12, 4, 64)] * 4


def test_head_dims_are_clipped_to_what_the_width_and_group_allow():
    assert head_dim_cap(384, 1) == 128 and head_dim_cap(768, 3) == 256 and head_dim_cap(64, 2) == 32
    assert head_dim_cap(96, 1) == 32 and head_dim_cap(30, 1) == 2
    # 20m preset: q_dim 384 allows at most 128 -> stages 128, 128, 64 (L=8: layers 0-1, 2-4, 5-7)
    cfg = cfg_of(PrismConfig(), d_model=384, n_heads=6, n_kv_heads=6, n_layers=8)
    assert shape(cfg) == [(3, 3, 128)] * 5 + [(6, 6, 64)] * 3
    # d=64 with group 2: every stage clips to 32: flat, still monotone
    assert shape(cfg_of(PrismConfig())) == [(2, 1, 32)] * 4


def test_stage_split_rule():
    # stage j holds layers floor(jL/S) .. floor((j+1)L/S) - 1 (the AttnRes block rule)
    assert [stage_of(l, 12, 3) for l in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert [stage_of(l, 4, 3) for l in range(4)] == [0, 1, 2, 2]
    assert [stage_of(l, 5, 3) for l in range(5)] == [0, 1, 1, 2, 2]
    assert [stage_of(l, 3, 1) for l in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("over", [
    dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=4),
    dict(d_model=64, n_heads=4, n_kv_heads=4, n_layers=5),
    dict(d_model=96, n_heads=6, n_kv_heads=3, n_layers=6),
    dict(d_model=768, n_heads=12, n_kv_heads=4, n_layers=12),
    dict(d_model=64, n_heads=4, n_kv_heads=1, n_layers=4, head_dim=32),  # q_dim 128 != d
])
def test_monotone_power_of_two_group_kept(over):
    for p in (PrismConfig(), PrismConfig(head_dims=[64, 32, 16, 8]), PrismConfig(head_dims=[16])):
        cfg = cfg_of(p, **over)
        group = cfg.n_heads // cfg.kv_heads
        q_dim = cfg.n_heads * cfg.dim_per_head
        heads = shape(cfg)
        assert all(a[0] <= b[0] for a, b in zip(heads, heads[1:]))  # head count never falls
        for h, kvh, hd in heads:
            assert hd & (hd - 1) == 0 and hd >= 2 and h * hd == q_dim
            assert h == kvh * group  # the base config's query-per-KV ratio, per layer


def test_explicit_per_layer_heads():
    cfg = cfg_of(PrismConfig(heads=[2, 2, 4, 8]), n_kv_heads=2)
    assert shape(cfg) == [(2, 1, 32), (2, 1, 32), (4, 2, 16), (8, 4, 8)]


@pytest.mark.parametrize("prism,match", [
    (PrismConfig(head_dims=[16, 32]), "model.prism.head_dims: must not increase"),
    (PrismConfig(head_dims=[48]), "model.prism.head_dims: 48 is not a power of two"),
    (PrismConfig(heads=[8, 4, 4, 4]), "model.prism.heads: must not decrease"),
    (PrismConfig(heads=[2, 2, 4]), "model.prism.heads: needs one entry per layer"),
    (PrismConfig(heads=[1, 2, 4, 4]), "model.prism.heads: 1 heads is not a multiple"),
    (PrismConfig(heads=[2, 2, 4, 64]), "model.prism.heads: 64 heads do not split"),  # head dim 1
    (PrismConfig(heads=[2, 2, 6, 6]), "model.prism.heads: 6 heads do not split"),  # not a power of two
    (PrismConfig(head_dims=[8, 8, 8, 8, 8]), "model.prism.head_dims: has 5 stages for 4 layers"),
])
def test_bad_schedules_are_config_errors(prism, match):
    with pytest.raises(ConfigError, match=match):
        cfg_of(prism)


def test_uniform_layer_heads_is_refused_with_prism():
    with pytest.raises(ConfigError, match="model.layer_heads: .*model.prism.heads"):
        make_config("tiny", overrides=["model.heads=prism", "model.layer_heads=[2,2,4,4]"])


@pytest.mark.parametrize("over", [
    dict(),
    dict(n_kv_heads=1),
    dict(d_model=768, n_heads=12, n_kv_heads=4, n_layers=12, vocab_size=512),
])
@pytest.mark.parametrize("branch", [False, True])
def test_costs_equal_the_baseline(over, branch):
    base, prism = cfg_of(**over), cfg_of(PrismConfig(head_dims=[256, 128, 32, 8]), **over)
    base.branch.enabled = prism.branch.enabled = branch
    assert shape(prism) != shape(base)
    for context in (1, 256):
        assert costs(prism, context) == costs(base, context)
        rows_b, rows_p = per_layer(base, context), per_layer(prism, context)
        for rb, rp, s in zip(rows_b, rows_p, layer_specs(prism)):
            assert (rp["heads"], rp["kv_heads"], rp["head_dim"]) == (s.n_heads, s.n_kv_heads, s.head_dim)
            for k in ("params", "prefill_flops_per_token", "decode_flops_per_token", "kv_bytes_per_token"):
                assert rp[k] == rb[k]


def test_built_model_has_the_baselines_parameters_and_flops():
    base, prism = cfg_of(n_layers=3), cfg_of(PrismConfig(head_dims=[32, 16, 8]), n_layers=3)
    torch.manual_seed(0)
    mb, mp = build_model(base).eval(), build_model(prism).eval()
    assert {k: v.shape for k, v in mp.state_dict().items()} == {k: v.shape for k, v in mb.state_dict().items()}
    assert sum(p.numel() for p in mp.parameters()) == costs(prism, 16)["params_total"]
    assert [(b.attn.n_heads, b.attn.n_kv_heads, b.attn.head_dim) for b in mp.layers] == shape(prism)
    assert shape(prism) == [(2, 1, 32), (4, 2, 16), (8, 4, 8)]
    x = torch.randint(0, 97, (2, 16))
    counts = []
    for m in (mb, mp):
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            m(x)
        counts.append(fc.get_total_flops())
    assert counts[0] == counts[1] > 0
    # the KV cache is as large as the baseline's
    cb, cp = mb.new_cache(2, 32), mp.new_cache(2, 32)

    def kv_elems(cache):  # the keys and values, not the attention kernel's split counters
        return sum(b.numel() for n, b in cache.named_buffers() if n != "split_counters")

    assert kv_elems(cb) == kv_elems(cp) > 0


def test_cached_decode_with_per_layer_head_dims():
    torch.manual_seed(1)
    model = build_model(cfg_of(PrismConfig(heads=[2, 4, 8, 8]))).eval()
    seqs = [torch.randint(1, 97, (n,)).tolist() for n in (11, 6)]
    assert_matches_full_forward(model, seqs, prompt_lens=[4, 2])
