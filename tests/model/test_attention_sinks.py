"""Attention sinks (``model.attn_sinks``): one more softmax slot per head with a learned logit and
a zero value, against a float64 reference; cached decoding; accounting."""

from __future__ import annotations

import math

import pytest
import torch

from archlab.model import build_model
from archlab.model.accounting import param_counts
from archlab.model.core.layers import sdpa
from tests.helpers import tiny_model_cfg
from tests.infer.test_generate import assert_matches_full_forward


def reference(q, k, v, sink, allowed):
    """softmax over [sink_h, q.k/sqrt(d) where allowed] and the zero value for the sink, in fp64."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink_col = sink.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    w = torch.softmax(torch.cat([sink_col, scores], -1), -1)[..., 1:]
    return w @ v


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("cached", [False, True])
def test_sdpa_with_sinks_matches_the_reference(kv_heads, cached):
    torch.manual_seed(0)
    b, h, t, s, d = 2, 4, 5, 9 if cached else 5, 8
    q = torch.randn(b, h, t, d)
    k, v = torch.randn(b, kv_heads, s, d), torch.randn(b, kv_heads, s, d)
    sink = torch.randn(h) * 2
    if cached:  # per-row validity, as a decode step's mask has it
        mask = torch.rand(b, 1, t, s) > 0.3
        mask[..., 0] = True
        got, allowed = sdpa(q, k, v, mask=mask, sink=sink), mask
    else:
        got, allowed = sdpa(q, k, v, causal=True, sink=sink), torch.ones(t, s, dtype=torch.bool).tril()
    want = reference(q, k, v, sink, allowed)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # a sink takes weight away: outputs shrink against plain attention
    plain = sdpa(q, k, v, mask=mask) if cached else sdpa(q, k, v, causal=True)
    assert got.norm() < plain.norm()


def test_model_with_sinks_decodes_from_the_cache_and_is_counted():
    torch.manual_seed(1)
    cfg = tiny_model_cfg(attn_sinks=True)
    cfg.branch.enabled = True
    model = build_model(cfg).eval()
    with torch.no_grad():
        for blk in model.layers:
            blk.attn.sink.normal_(0.0, 1.0)
    assert param_counts(cfg)["params_total"] == sum(p.numel() for p in model.parameters())
    sinks = sum(blk.attn.sink.numel() for blk in model.layers)
    off = tiny_model_cfg()
    off.branch.enabled = True
    assert param_counts(cfg)["params_total"] - param_counts(off)["params_total"] == sinks == 2 * 4
    seqs = [torch.randint(1, 97, (n,)).tolist() for n in (11, 6)]
    assert_matches_full_forward(model, seqs, prompt_lens=[4, 2])


def test_sinks_train():
    torch.manual_seed(2)
    model = build_model(tiny_model_cfg(attn_sinks=True))
    x = torch.randint(0, 97, (2, 12))
    model(x[:, :-1], x[:, 1:]).loss.backward()
    assert all(blk.attn.sink.grad is not None and blk.attn.sink.grad.abs().sum() > 0 for blk in model.layers)


@pytest.mark.parametrize("kv_heads,d", [(4, 8), (2, 12)])
def test_causal_sinks_keep_the_fused_path_and_its_gradients_exact(kv_heads, d):
    """The causal no-mask case (training, prefill) takes the augmented-key path: values and the
    gradients of q, k, v and the sink logits equal the float64 reference."""
    torch.manual_seed(3)
    b, h, t = 2, 4, 7
    q = torch.randn(b, h, t, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, t, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, t, d, dtype=torch.float64, requires_grad=True)
    sink = (torch.randn(h, dtype=torch.float64) * 2).requires_grad_()
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    got = sdpa(q, k, v, causal=True, sink=sink)
    want = reference(q, k, v, sink, allowed)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    grad_out = torch.randn_like(got)
    g_got = torch.autograd.grad(got, (q, k, v, sink), grad_out)
    g_want = torch.autograd.grad(want, (q, k, v, sink), grad_out)
    for a, e in zip(g_got, g_want):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)
