"""Choosing the next token on the device, per row, with no host synchronisation.

Every row of a batch carries its own temperature, top-k, top-p and seed as tensors, so one
captured decode step serves any mix of greedy and sampled requests. Sampling is the Gumbel-max
trick: ``argmax(logits / T + g)`` over the tokens top-k/top-p keep, where ``g = -log(-log u)``.

The uniform ``u`` is not drawn from a generator's state: it is a hash of (seed, position, token id)
(splitmix64 on int64 tensors). The same request therefore samples the same tokens whatever else
shares its batch, whichever slot it lands in, and whether the step is replayed from a CUDA graph:
a server's concurrent streams equal sequential generation, and tests can check it.

OpenAI's presence and frequency penalties and logit bias (``penalise``) shift a row's
log-probabilities before any of this, from per-row tensors and counts of the row's generated
tokens that the engine keeps on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 multipliers, as signed 64-bit integers
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens (the OpenAI completion parameters' meaning)."""

    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    stop_tokens: tuple[int, ...] = ()  # generation ends after emitting one of these (it is kept)
    seed: int = 0
    #: on a speculative engine, the most draft tokens of a step this request may accept (None: the
    #: engine's ``--speculate``; 0: none, one token per step as plain decoding gives)
    speculate: int | None = None
    #: OpenAI's penalties on the request's own generated tokens (``penalise``), each in [-2, 2]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: (token id, bias in [-100, 100]) pairs added to those tokens' logits at every step
    logit_bias: tuple[tuple[int, float], ...] = ()

    def check(self) -> None:
        """Raise ValueError naming the first parameter out of range (the server's 400s)."""
        if self.max_new_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.speculate is not None and self.speculate < 0:
            raise ValueError(f"speculate must be >= 0 (0 = no draft tokens), got {self.speculate}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias names a negative token id {token}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")

    @property
    def penalised(self) -> bool:
        """Whether the request changes its logits (penalties or a bias): the speculative step,
        which draws from the unchanged distribution, refuses such requests."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _lsr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: Tensor) -> Tensor:
    """splitmix64's finaliser: a bijection of 64-bit integers that scrambles every bit."""
    x = (x ^ _lsr(x, 30)) * _M1
    x = (x ^ _lsr(x, 27)) * _M2
    return x ^ _lsr(x, 31)


def token_keys(vocab: int, device: torch.device | str = "cpu") -> Tensor:
    """A 64-bit key per token id, [vocab] int64. Computed outside any compiled code: inside it,
    Triton would multiply the token index (an int32) by the 64-bit constant and fail."""
    return _mix(torch.arange(vocab, device=device, dtype=torch.long) * _GOLDEN)


def uniforms(seed: Tensor, position: Tensor, keys: Tensor) -> Tensor:
    """``u`` in (0, 1) for every (row, token id): [B, vocab], a pure function of the seed, the
    position and the token (``keys = token_keys(vocab)``)."""
    row = _mix(seed.long() * _GOLDEN + position.long())  # [B]
    return _unit(_mix(row[:, None] ^ keys[None, :]))


def uniform_at(seed: Tensor, position: Tensor, token: Tensor, keys: Tensor) -> Tensor:
    """``uniforms(seed, position, keys)[b, token[b]]`` for every row [B], without hashing the
    rest of the vocabulary."""
    row = _mix(seed.long() * _GOLDEN + position.long())
    return _unit(_mix(row ^ keys[token]))


def _unit(h: Tensor) -> Tensor:
    return (_lsr(h, 40).float() + 0.5) / float(1 << 24)  # 24 random bits, never 0 or 1


def penalise(logprobs: Tensor, counts: Tensor, presence: Tensor, frequency: Tensor, bias: Tensor) -> Tensor:
    """OpenAI's penalties and logit bias, per row, on log-probabilities [B, V] (fp32 out):
    ``x[t] + bias[t] - presence * [count[t] > 0] - frequency * count[t]``, where ``counts`` [B, V]
    counts each token among the row's generated tokens (not its prompt), ``presence`` and
    ``frequency`` are [B] and ``bias`` is [B, V]. Shifting log-probabilities shifts the logits by
    a per-row constant, which softmax ignores, so this is OpenAI's change of the logits. A row
    whose penalties and bias are all zero comes back exactly unchanged (x + 0 - 0 = x), so
    applying it to every row keeps one decode step for any mix of requests."""
    return logprobs.float() + bias - presence[:, None] * (counts > 0) - frequency[:, None] * counts


# ``restrict`` and ``sample`` run eagerly inside compiled steps: inductor (torch 2.11) failed to
# generate their sort/softmax. Marking a function so (``torch.compiler.disable``) imports
# torch._dynamo, 1.7 s of a 3.2 s eager ``archlab generate`` on a 2-core CPU, so the marked copies
# are made only by ``eager_inside_compiled``, which the engine calls before it compiles a step.
_MARKED: dict[str, Callable] = {}


def eager_inside_compiled() -> None:
    """Have ``restrict`` and ``sample`` run eagerly when compiled code calls them (call before
    compiling any code that calls them)."""
    if not _MARKED:
        _MARKED.update(restrict=torch.compiler.disable(_restrict), sample=torch.compiler.disable(_sample))


def restrict(logprobs: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """(the logits divided by each row's temperature, the tokens top-k and top-p keep) for
    log-probabilities [B, V]: what ``sample`` draws among, and ``sampling_probs`` normalises."""
    return _MARKED.get("restrict", _restrict)(logprobs, temperature, top_k, top_p)


def _restrict(logprobs: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    logits = logprobs.float()
    vocab = logits.shape[-1]
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    ordered, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab)
    keep = rank[None, :] < k[:, None]
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    keep &= (probs.cumsum(-1) - probs) < top_p[:, None]
    return scaled, torch.zeros_like(keep).scatter(-1, order, keep)  # back to token order


def sampling_probs(logprobs: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                   restricted: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The distribution ``sample`` draws each row's token from, [B, V] (fp32): the softmax of the
    scaled logits over the kept tokens, and for a greedy row (temperature 0) all the mass on its
    argmax. Speculative decoding's rejection rule compares two of these (``infer.speculative``).
    ``restricted``: ``restrict``'s result for these arguments, when the caller has it (one sort)."""
    scaled, kept = restricted or restrict(logprobs, temperature, top_k, top_p)
    probs = torch.softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)
    onehot = torch.zeros_like(probs).scatter(-1, logprobs.argmax(-1, keepdim=True), 1.0)
    return torch.where((temperature > 0)[:, None], probs, onehot)


def sample(logprobs: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor,
           position: Tensor, keys: Tensor | None = None, restricted: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """One token per row from log-probabilities [B, V]; rows with temperature 0 take the argmax.

    ``top_k`` keeps the k most likely tokens (0: all); ``top_p`` then keeps the smallest set of
    most likely tokens whose probability reaches ``top_p`` (a token is dropped when the tokens
    ranked above it already reach it; the first always stays). ``position`` is the position the
    chosen token will have in its sequence (part of the hash); ``keys`` is ``token_keys(V)``,
    which compiled callers pass in (computed once, outside the compiled code); ``restricted``:
    ``restrict``'s result for these arguments, when the caller has it.
    """
    return _MARKED.get("sample", _sample)(logprobs, temperature, top_k, top_p, seed, position, keys, restricted)


def _sample(logprobs: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor,
            position: Tensor, keys: Tensor | None, restricted: tuple[Tensor, Tensor] | None) -> Tensor:
    greedy = logprobs.argmax(-1)
    scaled, kept = restricted or restrict(logprobs, temperature, top_k, top_p)
    if keys is None:
        keys = token_keys(logprobs.shape[-1], logprobs.device)
    gumbel = -torch.log(-torch.log(uniforms(seed, position, keys)))
    chosen = (scaled + gumbel).masked_fill(~kept, float("-inf")).argmax(-1)
    return torch.where(temperature > 0, chosen, greedy)
