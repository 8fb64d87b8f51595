"""The baseline model: causality, KV-cached decoding, exact accounting."""

from __future__ import annotations

import pytest
import torch

from archlab.model.config import ModelConfig
from archlab.model import build_model
from archlab.model.accounting import costs, decode_bytes_per_step, param_counts
from tests.helpers import tiny_model_cfg


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_causality(kv_heads):
    torch.manual_seed(0)
    model = build_model(tiny_model_cfg(n_kv_heads=kv_heads)).eval()
    x = torch.randint(0, 97, (3, 20))
    base = model(x).logits
    for t in (0, 7, 19):
        y = x.clone()
        y[:, t] = (y[:, t] + 1) % 97
        out = model(y).logits
        assert torch.equal(out[:, :t], base[:, :t]), f"changing token {t} changed earlier logits"
        assert not torch.allclose(out[:, t], base[:, t]), "the changed token did not affect its own logits"


def test_tied_embeddings_share_storage():
    model = build_model(tiny_model_cfg(tie_embeddings=True))
    assert model.lm_head.weight is model.tok_emb.weight
    untied = build_model(tiny_model_cfg())
    n_tied = sum(p.numel() for p in model.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 97 * 32


def test_per_layer_head_schedule():
    cfg = tiny_model_cfg(n_layers=3, n_heads=4, n_kv_heads=2, layer_heads=[2, 4, 8])
    model = build_model(cfg)
    assert [blk.attn.head_dim for blk in model.layers] == [16, 8, 4]
    assert [blk.attn.n_kv_heads for blk in model.layers] == [1, 2, 4]
    out = model(torch.randint(0, 97, (2, 9)))
    assert out.logits.shape == (2, 9, 97)


def _hand_count(d, L, V, H, KV, hd, hidden, tied):
    attn = d * H * hd + 2 * d * KV * hd + H * hd * d
    mlp = 3 * d * hidden
    norms = 2 * d
    return V * d + (0 if tied else V * d) + L * (attn + mlp + norms) + d


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_matches_hand_count_and_module(tied):
    cfg = ModelConfig(vocab_size=1000, d_model=96, n_layers=3, n_heads=6, n_kv_heads=2, tie_embeddings=tied)
    # hidden: 8/3 * 96 = 256, already a multiple of 64
    assert cfg.hidden == 256
    hand = _hand_count(96, 3, 1000, 6, 2, 16, 256, tied)
    assert param_counts(cfg)["params_total"] == hand
    assert sum(p.numel() for p in build_model(cfg).parameters()) == hand


def test_flop_accounting_matches_hand_count():
    cfg = ModelConfig(vocab_size=1000, d_model=96, n_layers=3, n_heads=6, n_kv_heads=2)
    d, L, V, q, kv, hidden = 96, 3, 1000, 96, 32, 256
    matmul = L * (d * q + 2 * d * kv + q * d + 3 * d * hidden) + d * V
    S, C = 128, 512
    c = costs(cfg, context=S)
    # prefill: mean keys per position is (S+1)/2; attention = 4 * q_dim * keys per layer
    assert c["prefill_flops_per_token"] == pytest.approx(2 * matmul + L * 4 * q * (S + 1) / 2)
    assert c["train_flops_per_token"] == pytest.approx(3 * c["prefill_flops_per_token"])
    assert costs(cfg, context=C)["decode_flops_per_token"] == pytest.approx(2 * matmul + L * 4 * q * C)
    # KV bytes per token: keys + values, every layer, 2-byte elements
    assert c["kv_bytes_per_token"] == L * 2 * kv * 2
    # one decode step at batch 1: every matmul weight + one embedding row + the KV cache + the new KV
    expect = (matmul + L * 2 * d + d + d) * 2 + C * L * 2 * kv * 2 + L * 2 * kv * 2
    assert decode_bytes_per_step(cfg, C) == pytest.approx(expect)
