"""Shared by model tests: cached decoding through the engine must reproduce the full forward.

(Kept at this path so that variant tests import ``assert_matches_full_forward`` from one place.)
"""

from __future__ import annotations

import torch

from archlab.infer.engine import Engine
from archlab.infer.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=32, temperature=0)


def teacher_forced(model, seqs: list[list[int]], prompt_lens: list[int]) -> list[list[torch.Tensor]]:
    """Log-probabilities predicted after each prompt, fed the true continuation token by token
    through the engine's prefill and decode steps. One slot more than the sequences stays free, so
    the free slot's (ignored) work is exercised too."""
    n = len(seqs)
    eng = Engine(model, slots=n + 1, max_len=model.cfg.max_seq_len)
    rows = list(range(n))
    _, lp = eng.prefill(rows, [s[:p] for s, p in zip(seqs, prompt_lens)], [GREEDY] * n)
    got = [[lp[i].clone()] for i in range(n)]
    steps = max(len(s) - p for s, p in zip(seqs, prompt_lens)) - 1
    for j in range(steps):
        eng.tokens[:n] = torch.tensor([s[p + j] if p + j < len(s) else 0 for s, p in zip(seqs, prompt_lens)],
                                      device=eng.device)
        eng.step(greedy=True)
        for i in range(n):
            got[i].append(eng.logprobs[i].clone())
    return got


def assert_matches_full_forward(model, seqs, prompt_lens, atol=1e-5):
    """Every cached prediction equals the readout of the full uncached forward (fp32)."""
    got = teacher_forced(model, seqs, prompt_lens)
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        with torch.no_grad():
            ref = model.log_probs(model(torch.tensor([s], device=model.lm_head.weight.device)))[0]
        for j in range(len(s) - p):
            torch.testing.assert_close(got[i][j], ref[p - 1 + j], atol=atol, rtol=0)
