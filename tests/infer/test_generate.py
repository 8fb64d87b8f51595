"""Cached generation: prefill + incremental decode reproduce the full forward; sampling rules."""

from __future__ import annotations

import pytest
import torch

from archlab.infer.generate import Generator, Sampling, sample
from archlab.model import build_model
from tests.helpers import tiny_model_cfg


def teacher_forced(gen: Generator, seqs: list[list[int]], prompt_lens: list[int]) -> list[list[torch.Tensor]]:
    """Log-probabilities predicted after each prompt, fed the true continuation token by token."""
    state, lp = gen.start([s[:p] for s, p in zip(seqs, prompt_lens)], max_new_tokens=32)
    got = [[lp[i]] for i in range(len(seqs))]
    steps = max(len(s) - p for s, p in zip(seqs, prompt_lens)) - 1
    for j in range(steps):
        nxt = torch.tensor([s[p + j] if p + j < len(s) else 0 for s, p in zip(seqs, prompt_lens)])
        lp = gen.advance(state, nxt)
        for i in range(len(seqs)):
            got[i].append(lp[i])
    return got


def assert_matches_full_forward(model, seqs, prompt_lens, atol=1e-5):
    got = teacher_forced(Generator(model), seqs, prompt_lens)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        ref = model.log_probs(model(torch.tensor([s])))[0]
        for j in range(len(s) - p):
            torch.testing.assert_close(got[i][j], ref[p - 1 + j], atol=atol, rtol=0)


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_cached_decoding_matches_full_forward_ragged_batch(kv_heads):
    torch.manual_seed(1)
    model = build_model(tiny_model_cfg(n_kv_heads=kv_heads)).eval()
    seqs = [torch.randint(1, 97, (n,)).tolist() for n in (12, 7, 15)]
    assert_matches_full_forward(model, seqs, prompt_lens=[5, 1, 9])


def test_generate_is_seeded_and_stops():
    torch.manual_seed(2)
    model = build_model(tiny_model_cfg()).eval()
    gen = Generator(model)
    prompts = [[5, 6, 7], [8]]
    a = gen.generate(prompts, Sampling(max_new_tokens=10, temperature=1.0, seed=3))
    b = gen.generate(prompts, Sampling(max_new_tokens=10, temperature=1.0, seed=3))
    assert a == b and all(len(x) == 10 for x in a)
    # greedy generation equals the argmax of the full forward, step by step
    greedy = gen.generate([[5, 6, 7]], Sampling(max_new_tokens=6, temperature=0))[0]
    seq = [5, 6, 7]
    for t in greedy:
        assert t == int(model(torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(t)
    # a stop token ends that row (kept as its last token)
    stop = greedy[2]
    out = gen.generate([[5, 6, 7]], Sampling(max_new_tokens=6, temperature=0, stop_tokens=(stop,)))[0]
    assert out == greedy[: greedy.index(stop) + 1]


def test_top_k_and_top_p_restrict_support():
    logits = torch.log_softmax(torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]), -1).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    top2 = sample(logits, Sampling(temperature=1.0, top_k=2), gen)
    assert set(top2.tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)
    # top_p just above p0 keeps tokens 0 and 1 only
    top_p = sample(logits, Sampling(temperature=1.0, top_p=float(p[0]) + 1e-3), gen)
    assert set(top_p.tolist()) == {0, 1}
    assert sample(logits[:1], Sampling(temperature=0)).item() == 0


def test_prompt_too_long_is_rejected():
    model = build_model(tiny_model_cfg(max_seq_len=16)).eval()
    with pytest.raises(ValueError, match="max_seq_len"):
        Generator(model).start([[1] * 10], max_new_tokens=10)
