"""Every model option decodes through archlab's decode-attention kernel
(``layers.DECODE_ATTENTION = "triton"``; Triton's CPU interpreter here) exactly as its full
uncached forward predicts: one row per sequence or the decode branch's several, grouped-query
heads, per-layer head dimensions (Prism, variable width), sinks, MoE, depth routing, a looped
schedule; with ``layers.DECODE_LINEAR = "triton"`` the step's matmuls run on the skinny-matmul
kernel as well. The kernels themselves are tested against float64 in
tests/kernels/test_decode_attention.py and test_skinny_matmul.py; this checks how the model calls it (the rows' layout,
lengths from the positions, the sink per head, the cache entry per visit)."""

from __future__ import annotations

import pytest
import torch

from archlab.model import build_model
from archlab.model.core import layers
from tests.infer.test_generate import assert_matches_full_forward
from tests.model.variants.test_zoo_pairs import OPTIONS, run_config

from archlab.kernels import interpreting

pytestmark = pytest.mark.skipif(layers._decode_attention_kernel is None or not interpreting(),
                                reason="needs Triton in its CPU interpreter (these models run on CPU)")

CASES = {
    "baseline": [],
    **{name: [name] for name in OPTIONS},
    "branch-2": ["branch"],
}
EXTRA = {
    "branch-2": ("model.branch.n_branches=2",),
    "baseline": ("model.attn_sinks=true",),
}


def randomised_model(cfg, seed: int):
    """The config's model with random coupling vectors and sinks (zero at init), so that a
    misplaced row or sink fails."""
    torch.manual_seed(seed)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".couple_" in name or name.endswith(".sink"):
                torch.nn.init.normal_(p, 0.0, 0.5)
    return model


@pytest.mark.parametrize("linear", ["cublas", "triton", "triton+gated"])
@pytest.mark.parametrize("case", list(CASES))
def test_decoding_on_the_kernel_reproduces_the_full_forward(monkeypatch, case, linear):
    """``triton+gated``: SwiGLU's gating inside ``w_down``'s kernel too (``DECODE_SWIGLU``)."""
    linear, _, gated = linear.partition("+")
    monkeypatch.setattr(layers, "DECODE_ATTENTION", "triton")
    monkeypatch.setattr(layers, "DECODE_LINEAR", linear)
    monkeypatch.setattr(layers, "DECODE_SWIGLU", "fused" if gated else "unfused")
    cfg = run_config(*CASES[case], extra=EXTRA.get(case, ()))
    model = randomised_model(cfg, seed=1)
    calls = []
    kernel = layers._decode_attention_kernel
    monkeypatch.setattr(layers, "_decode_attention_kernel", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    products = []
    skinny = layers._skinny_matmul_kernel
    monkeypatch.setattr(layers, "_skinny_matmul_kernel",
                        lambda *a: products.append((a[1].shape, a[2:] == (True,))) or skinny(*a))
    seqs = [torch.randint(1, 97, (n,)).tolist() for n in (12, 5, 9)]
    assert_matches_full_forward(model, seqs, prompt_lens=[3, 2, 7])
    assert calls, "the decode steps did not run the kernel"
    if linear == "triton":  # every decode step's unembedding, at least, is a skinny product
        assert ((cfg.model.vocab_size, model.lm_head.weight.shape[1]), False) in products
    else:
        assert not products
    # the gated product exactly where a SwiGLU's w_down (MoE's shared expert too) runs in a pass
    # whose taps change nothing (the baseline's; the decode branch couples its rows at the gated
    # activation)
    from archlab.model.core.ffn import SwiGLU

    swiglu = any(isinstance(m, SwiGLU) for m in model.modules()) and not cfg.model.branch.enabled
    assert any(g for _, g in products) == (bool(gated) and swiglu), products


def test_skinny_products_only_without_gradients_and_up_to_max_rows(monkeypatch):
    monkeypatch.setattr(layers, "DECODE_LINEAR", "triton")
    calls = []
    monkeypatch.setattr(layers, "_skinny_matmul_kernel", lambda x, w: calls.append(x.shape) or x @ w.T)
    lin = layers.Linear(8, 5)
    x = torch.randn(layers._SKINNY_MAX_ROWS + 1, 8)
    with torch.no_grad():
        lin(x[:2])
        lin(x[:, None])  # [17, 1, 8]: 17 rows
    assert calls == [(2, 8)]
    lin(x[:2]).sum().backward()  # training: cuBLAS, with gradients
    assert calls == [(2, 8)] and lin.weight.grad is not None
    monkeypatch.setattr(layers, "DECODE_LINEAR", "auto")
    with torch.no_grad():
        lin(x[:2])  # auto: the kernel on CUDA only
    assert calls == [(2, 8)]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert layers.skinny_matmul_for(cuda, 1, layers.AUTO_MAX_OUT)  # measured faster there
    assert not layers.skinny_matmul_for(cuda, layers.AUTO_MAX_ROWS + 1, 8)  # more rows: cuBLAS
    assert not layers.skinny_matmul_for(cuda, 1, layers.AUTO_MAX_OUT + 1)  # wider: cuBLAS
    assert not layers.skinny_matmul_for(cpu, 1, 8)
    monkeypatch.setattr(layers, "DECODE_LINEAR", "triton")
    assert layers.skinny_matmul_for(cpu, layers._SKINNY_MAX_ROWS, 1 << 16)
    assert not layers.skinny_matmul_for(cpu, layers._SKINNY_MAX_ROWS + 1, 8)
    monkeypatch.setattr(layers, "DECODE_LINEAR", "gemv")
    with pytest.raises(ValueError, match="DECODE_LINEAR"):
        lin(x[:2])


def test_auto_picks_sdpa_on_cpu_and_the_kernel_on_cuda(monkeypatch):
    monkeypatch.setattr(layers, "DECODE_ATTENTION", "auto")
    assert layers.decode_kernel_for(torch.device("cpu")) is None
    assert layers.decode_kernel_for(torch.device("cuda")) is layers._decode_attention_kernel
    monkeypatch.setattr(layers, "DECODE_ATTENTION", "sdpa")
    assert layers.decode_kernel_for(torch.device("cuda")) is None
    monkeypatch.setattr(layers, "DECODE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="DECODE_ATTENTION"):
        layers.decode_kernel_for(torch.device("cpu"))


def test_split_caches_are_merged_inside_the_kernel(monkeypatch):
    """With the cache split over several programs per head, the last of them merges the splits
    (the split counters the KV cache holds): prefill's appended rows and every decode step, many
    launches on one counter buffer, still reproduce the full forward. Two branches: three rows
    per sequence, the primary's among them (the kernel's own tests cover one row)."""
    from archlab.kernels import decode_attention

    monkeypatch.setattr(layers, "DECODE_ATTENTION", "triton")
    monkeypatch.setattr(decode_attention, "BLOCK_N", 16)
    monkeypatch.setattr(decode_attention, "MIN_SPLIT", 16)  # the tests' 64-slot cache: 4 splits
    cfg = run_config(*CASES["branch-2"], extra=EXTRA["branch-2"])
    model = randomised_model(cfg, seed=2)
    fused = []
    kernel = layers._decode_attention_kernel
    monkeypatch.setattr(layers, "_decode_attention_kernel",
                        lambda *a, **k: fused.append(k.get("counters") is not None) or kernel(*a, **k))
    seqs = [torch.randint(1, 97, (n,)).tolist() for n in (36, 20, 26)]  # up to 3 of the 4 splits hold slots
    assert_matches_full_forward(model, seqs, prompt_lens=[30, 6, 20])
    assert fused and all(fused)
    assert decode_attention.default_splits(4, cfg.model.n_kv_heads, cfg.model.max_seq_len) > 1


@pytest.mark.parametrize("case", list(CASES))
def test_decoding_with_the_fused_rope_cache_kernel_reproduces_the_full_forward(monkeypatch, case):
    """``layers.DECODE_ROPE = "triton"``: every decode step rotates q and k and writes the cache in
    archlab's one kernel (follower rows, per-layer head dims, cache entries per visit), and the
    tokens' logits still equal the full forward's."""
    monkeypatch.setattr(layers, "DECODE_ATTENTION", "triton")
    monkeypatch.setattr(layers, "DECODE_ROPE", "triton")
    cfg = run_config(*CASES[case], extra=EXTRA.get(case, ()))
    model = randomised_model(cfg, seed=3)
    calls = []
    kernel = layers._rope_cache_kernel
    monkeypatch.setattr(layers, "_rope_cache_kernel", lambda *a: calls.append(a[0].shape) or kernel(*a))
    seqs = [torch.randint(1, 97, (n,)).tolist() for n in (12, 5, 9)]
    assert_matches_full_forward(model, seqs, prompt_lens=[3, 2, 7])
    assert cfg.model.position == "rope" and calls, "the decode steps did not run the fused kernel"
    assert all(shape[1] == 1 for shape in calls)  # decode steps only, never a prefill


def test_auto_fuses_rope_and_cache_writes_on_cuda_only(monkeypatch):
    monkeypatch.setattr(layers, "DECODE_ROPE", "auto")
    assert not layers.rope_cache_for(torch.device("cpu"))
    assert layers.rope_cache_for(torch.device("cuda")) == (layers._rope_cache_kernel is not None)
    monkeypatch.setattr(layers, "DECODE_ROPE", "torch")
    assert not layers.rope_cache_for(torch.device("cuda"))
    monkeypatch.setattr(layers, "DECODE_ROPE", "fused")
    with pytest.raises(ValueError, match="DECODE_ROPE"):
        layers.rope_cache_for(torch.device("cpu"))


def test_fused_swiglu_only_where_w_down_is_a_skinny_product(monkeypatch):
    """``DECODE_SWIGLU = "fused"`` follows ``DECODE_LINEAR``'s choice for ``w_down``: never on
    the CPU under auto, never with gradients, never for a width that is not gate-and-up."""
    monkeypatch.setattr(layers, "DECODE_SWIGLU", "fused")
    w = torch.randn(8, 16)
    h = torch.randn(1, 1, 32)
    monkeypatch.setattr(layers, "DECODE_LINEAR", "auto")
    with torch.no_grad():
        assert layers.gated_linear(h, w) is None  # auto: the kernel on CUDA only
    monkeypatch.setattr(layers, "DECODE_LINEAR", "triton")
    calls = []
    monkeypatch.setattr(layers, "_skinny_matmul_kernel", lambda *a: calls.append(a[2:]) or a[0][..., :8])
    with torch.no_grad():
        assert layers.gated_linear(h, w) is not None and calls == [(True,)]
        assert layers.gated_linear(torch.randn(1, 1, 30), w) is None  # not 2 x 16 wide
    assert layers.gated_linear(h, w.requires_grad_()) is None  # training: the plain path
    monkeypatch.setattr(layers, "DECODE_SWIGLU", "unfused")
    with torch.no_grad():
        assert layers.gated_linear(h, w) is None
    monkeypatch.setattr(layers, "DECODE_SWIGLU", "gated")
    with pytest.raises(ValueError, match="DECODE_SWIGLU"):
        layers.gated_linear(h, w)
