"""Generation: KV-cache prefill plus incremental decode, batched over ragged prompts.

Prompts are left-padded to a common length so that every row writes the same cache slot at each
step (static shapes: the decode step compiles once). Each row carries its own RoPE positions and a
key-validity mask that hides its padding.

The model's rows kind arranges the two phases (``Transformer.prefill`` / ``decode``); with the
decode branch (spec section 1) prefill runs the primary path, which writes the only KV cache, and
the branch row of the last prompt token in the same call; every later step runs the primary row
and the branch rows of the new token as one stacked group (one matrix multiply per weight, one
attention call reading the cache once). Both phases return the readout's log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from archlab.model.core.decoder import Transformer
from archlab.model.core.layers import KVCache


@dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    stop_tokens: tuple[int, ...] = ()
    seed: int = 0


@dataclass
class DecodeState:
    cache: KVCache
    step: DecodeStep | torch.nn.Module
    pad: Tensor  # [B] left padding per row
    key_valid: Tensor  # [B, max_len]
    next_slot: int  # cache slot the next token is written to


class DecodeStep(torch.nn.Module):
    """One grouped decode step with the cache held as module buffers, so that a compiled,
    CUDA-graphed step sees static addresses (the gpt-fast recipe)."""

    def __init__(self, model: Transformer, cache: KVCache):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, idx: Tensor, input_pos: Tensor, rope_pos: Tensor, key_valid: Tensor) -> Tensor:
        return self.model.decode(idx, self.cache, input_pos, rope_pos, key_valid)


class Generator:
    def __init__(self, model: Transformer, compile_decode: bool = False):
        self.model = model.eval()
        self.compile_decode = compile_decode

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    # ---- the two phases ------------------------------------------------------------------------
    @torch.no_grad()
    def start(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[DecodeState, Tensor]:
        """Prefill; returns the state and the prediction's log-probabilities at the last prompt token."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        b, s = len(prompts), max(len(p) for p in prompts)
        max_len = s + max_new_tokens
        if max_len > self.model.cfg.max_seq_len:
            raise ValueError(f"prompt ({s}) + new tokens ({max_new_tokens}) exceed model.max_seq_len="
                             f"{self.model.cfg.max_seq_len}")
        dev = self.device
        pad = torch.tensor([s - len(p) for p in prompts], device=dev)
        tokens = torch.zeros(b, s, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            tokens[i, s - len(p):] = torch.tensor(p, dtype=torch.long)
        slots = torch.arange(max_len, device=dev)
        key_valid = slots[None, :] >= pad[:, None]
        cache = self.model.new_cache(b, max_len)
        input_pos = torch.arange(s, device=dev)
        rope_pos = (input_pos[None, :] - pad[:, None]).clamp_min(0)
        logprobs = self.model.prefill(tokens, cache, input_pos, rope_pos, key_valid)
        step = DecodeStep(self.model, cache)
        if self.compile_decode:
            step = torch.compile(step, mode="reduce-overhead")
        return DecodeState(cache, step, pad, key_valid, s), logprobs

    @torch.no_grad()
    def advance(self, state: DecodeState, tokens: Tensor) -> Tensor:
        """Feed one new token per row ([B]); returns the next prediction's log-probabilities."""
        dev = self.device
        idx = tokens.view(-1, 1).to(dev)
        input_pos = torch.tensor([state.next_slot], device=dev)
        rope_pos = (input_pos[None, :] - state.pad[:, None]).clamp_min(0)
        logprobs = state.step(idx, input_pos, rope_pos, state.key_valid)
        state.next_slot += 1
        return logprobs

    # ---- sampling loop -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """New tokens per prompt (stopping after a stop token, which is kept)."""
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        state, logprobs = self.start(prompts, sampling.max_new_tokens)
        outs: list[list[int]] = [[] for _ in prompts]
        done = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        stops = torch.tensor(list(sampling.stop_tokens) or [-1], device=self.device)
        for i in range(sampling.max_new_tokens):
            nxt = sample(logprobs, sampling, gen)
            for r, t in enumerate(nxt.tolist()):
                if not done[r]:
                    outs[r].append(t)
            done |= torch.isin(nxt, stops)
            if bool(done.all()) or i == sampling.max_new_tokens - 1:
                break
            logprobs = self.advance(state, nxt)
        return outs


def sample(logprobs: Tensor, s: Sampling, gen: torch.Generator | None = None) -> Tensor:
    """One token per row from log-probabilities [B, V] with temperature, top-k and top-p."""
    if s.temperature <= 0:
        return logprobs.argmax(-1)
    logits = logprobs.float() / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= s.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)
