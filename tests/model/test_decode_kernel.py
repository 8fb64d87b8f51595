"""Every model option decodes through archlab's decode-attention kernel
(``layers.DECODE_ATTENTION = "triton"``; Triton's CPU interpreter here) exactly as its full
uncached forward predicts: one row per sequence or the decode branch's several, grouped-query
heads, per-layer head dimensions (Prism, variable width), sinks, MoE, depth routing, a looped
schedule. The kernel itself is tested against float64 attention in
tests/kernels/test_decode_attention.py; this checks how the model calls it (the rows' layout,
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


@pytest.mark.parametrize("case", list(CASES))
def test_decoding_on_the_kernel_reproduces_the_full_forward(monkeypatch, case):
    monkeypatch.setattr(layers, "DECODE_ATTENTION", "triton")
    cfg = run_config(*CASES[case], extra=EXTRA.get(case, ()))
    torch.manual_seed(1)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".couple_" in name or name.endswith(".sink"):
                torch.nn.init.normal_(p, 0.0, 0.5)  # random, so that a misplaced row or sink fails
    calls = []
    kernel = layers._decode_attention_kernel
    monkeypatch.setattr(layers, "_decode_attention_kernel", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    seqs = [torch.randint(1, 97, (n,)).tolist() for n in (12, 5, 9)]
    assert_matches_full_forward(model, seqs, prompt_lens=[3, 2, 7])
    assert calls, "the decode steps did not run the kernel"


def test_auto_picks_sdpa_on_cpu_and_the_kernel_on_cuda(monkeypatch):
    monkeypatch.setattr(layers, "DECODE_ATTENTION", "auto")
    assert layers.decode_kernel_for(torch.device("cpu")) is None
    assert layers.decode_kernel_for(torch.device("cuda")) is layers._decode_attention_kernel
    monkeypatch.setattr(layers, "DECODE_ATTENTION", "sdpa")
    assert layers.decode_kernel_for(torch.device("cuda")) is None
    monkeypatch.setattr(layers, "DECODE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="DECODE_ATTENTION"):
        layers.decode_kernel_for(torch.device("cpu"))
