"""OpenAI's presence and frequency penalties and logit bias in the engine's sampler: the sampler's
distribution against a hand computation on a tiny vocabulary, the engine's per-slot counts
against uncached decoding that applies the definitions itself, and zero penalties changing
nothing."""

from __future__ import annotations

import math

import pytest
import torch

from archlab.infer.engine import Engine, Request, Scheduler
from archlab.infer.sampling import SamplingParams, penalise, sample, sampling_probs
from archlab.model import build_model
from tests.helpers import tiny_model_cfg

LOGITS = [1.5, 0.2, -0.7, 2.1, 0.0, -1.3]
COUNTS = [0, 3, 1, 2, 0, 0]  # how often each token appears among the generated ones


def hand_probs(presence: float, frequency: float, bias: dict[int, float], temperature: float) -> list[float]:
    """OpenAI's definition, in plain float arithmetic: logit - presence * [count > 0]
    - frequency * count + bias, divided by the temperature, softmaxed."""
    z = [(x - presence * (c > 0) - frequency * c + bias.get(t, 0.0)) / temperature
         for t, (x, c) in enumerate(zip(LOGITS, COUNTS))]
    top = max(z)
    e = [math.exp(v - top) for v in z]
    return [v / sum(e) for v in e]


def sampler_probs(presence: float, frequency: float, bias: dict[int, float], temperature: float) -> torch.Tensor:
    """What the engine's sampler draws from for one row with these parameters."""
    logprobs = torch.log_softmax(torch.tensor([LOGITS]), -1)
    bias_row = torch.zeros(1, len(LOGITS))
    for t, b in bias.items():
        bias_row[0, t] = b
    adjusted = penalise(logprobs, torch.tensor([COUNTS], dtype=torch.float), torch.tensor([presence]),
                        torch.tensor([frequency]), bias_row)
    return sampling_probs(adjusted, torch.tensor([temperature]), torch.tensor([0]), torch.tensor([1.0]))[0]


@pytest.mark.parametrize("presence,frequency,bias", [
    (0.8, 0.0, {}),  # presence alone: every generated token once, whatever its count
    (0.0, 0.5, {}),  # frequency alone: in proportion to the count
    (0.0, 0.0, {4: 3.0, 3: -100.0}),  # bias alone, -100 all but bans a token
    (-1.0, 1.5, {0: -2.5}),  # all three, a negative presence penalty encouraging repeats
])
def test_each_parameter_changes_the_distribution_as_openai_defines_it(presence, frequency, bias):
    got = sampler_probs(presence, frequency, bias, temperature=0.7)
    want = torch.tensor(hand_probs(presence, frequency, bias, 0.7))
    torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=0)
    plain = sampler_probs(0.0, 0.0, {}, temperature=0.7)
    assert (got - plain).abs().max() > 0.01  # it did change something


def test_zero_penalties_leave_the_log_probabilities_exactly_unchanged():
    torch.manual_seed(0)
    x = torch.log_softmax(torch.randn(3, 11), -1)
    counts = torch.randint(0, 4, (3, 11)).float()
    zero = torch.zeros(3)
    assert torch.equal(penalise(x, counts, zero, zero, torch.zeros(3, 11)), x)


def uncached(model, prompt: list[int], sp: SamplingParams) -> list[int]:
    """Decoding without a cache that applies the definitions itself: counts over the tokens
    generated so far, the penalties and bias on the full forward's last log-probabilities, then
    the sampler's own draw at the chosen token's position."""
    seq, out = list(prompt), []
    counts = torch.zeros(1, model.cfg.vocab_size)
    bias = torch.zeros(1, model.cfg.vocab_size)
    for t, b in sp.logit_bias:
        bias[0, t] = b
    with torch.no_grad():
        for _ in range(sp.max_new_tokens):
            lp = model.log_probs(model(torch.tensor([seq])))[0, -1:]
            adjusted = lp + bias - sp.presence_penalty * (counts > 0) - sp.frequency_penalty * counts
            t = int(sample(adjusted, torch.tensor([sp.temperature]), torch.tensor([sp.top_k]),
                           torch.tensor([sp.top_p]), torch.tensor([sp.seed]), torch.tensor([len(seq)]))[0])
            out.append(t)
            seq.append(t)
            counts[0, t] += 1
    return out


def test_engine_applies_each_rows_penalties_over_its_own_tokens():
    """Four requests share the batch, each with its own penalties; through two slots, so a slot
    is reused and its counts must start again from zero. A bias of 8 on one token makes the tiny
    random model repeat it; a frequency penalty then lets it repeat only until 8 - 2 * count
    falls behind the other tokens."""
    torch.manual_seed(3)
    model = build_model(tiny_model_cfg()).eval()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [5, 6, 7]]
    params = [SamplingParams(max_new_tokens=10, temperature=0, frequency_penalty=2.0, logit_bias=((40, 8.0),)),
              SamplingParams(max_new_tokens=8, temperature=0, presence_penalty=2.0, logit_bias=((40, 6.0),)),
              SamplingParams(max_new_tokens=9, temperature=0.9, seed=4, frequency_penalty=1.2, presence_penalty=-0.5,
                             logit_bias=((3, -100.0), (17, 2.0))),
              SamplingParams(max_new_tokens=10, temperature=0, logit_bias=((40, 8.0),))]
    got = Engine(model, slots=2).generate(prompts, params)
    for r, p, sp in zip(got, prompts, params):
        assert r.tokens == uncached(model, p, sp)
    assert 3 not in got[2].tokens and got[3].tokens.count(40) > got[0].tokens.count(40) >= 1


def test_a_greedy_request_without_penalties_is_unchanged_beside_penalised_ones():
    torch.manual_seed(4)
    model = build_model(tiny_model_cfg()).eval()
    plain = SamplingParams(max_new_tokens=12, temperature=0)
    alone = Engine(model, slots=1).generate([[1, 2, 3]], plain)[0].tokens
    mixed = Engine(model, slots=3).generate(
        [[4, 5], [1, 2, 3], [6]], [SamplingParams(max_new_tokens=12, temperature=0, frequency_penalty=2.0),
                                   plain, SamplingParams(max_new_tokens=12, temperature=0, logit_bias=((2, 50.0),))])
    assert mixed[1].tokens == alone == uncached(model, [1, 2, 3], plain)


def test_only_steps_with_a_penalised_request_pay_for_penalties(monkeypatch):
    """The decode step applies the penalties (a [slots, V] pass and the counts' update) only
    while a penalised request is running: a plain request's steps skip them. One slot runs a
    plain request, then a penalised one, then a plain one: each keeps its exact tokens, and the
    decode steps' penalty passes are the penalised request's steps alone."""
    import archlab.infer.engine as engine_module

    torch.manual_seed(5)
    model = build_model(tiny_model_cfg()).eval()
    calls = []
    real = engine_module.penalise

    def counted(logprobs, *args):
        calls.append(logprobs.shape[0])
        return real(logprobs, *args)

    monkeypatch.setattr(engine_module, "penalise", counted)
    plain = SamplingParams(max_new_tokens=6, temperature=0)
    penalised = SamplingParams(max_new_tokens=7, temperature=0, frequency_penalty=2.0, logit_bias=((40, 8.0),))
    prompts, params = [[1, 2, 3], [5, 6, 7], [1, 2, 3]], [plain, penalised, plain]
    got = Engine(model, slots=1).generate(prompts, params)
    for r, prompt, sp in zip(got, prompts, params):
        assert r.tokens == uncached(model, prompt, sp)
    prefills = 3  # every prefill applies the bias to its first token (counts are zero there)
    assert len(calls) == prefills + (penalised.max_new_tokens - 1)


@pytest.mark.parametrize("params,words", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2]"),
    (dict(logit_bias=((5, 101.0),)), "logit_bias values must be in [-100, 100]"),
    (dict(logit_bias=((97, 1.0),)), "outside the vocabulary of 97"),
])
def test_out_of_range_values_are_refused(params, words):
    model = build_model(tiny_model_cfg()).eval()
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        Scheduler(Engine(model, slots=1)).check(Request([1, 2], SamplingParams(max_new_tokens=2, **params)))


@pytest.mark.parametrize("request_kwargs,words", [
    (dict(params=SamplingParams(max_new_tokens=2, frequency_penalty=0.5)), "without --speculate"),
    (dict(params=SamplingParams(max_new_tokens=2, logit_bias=((3, 1.0),))), "without --speculate"),
    (dict(params=SamplingParams(max_new_tokens=2), top_logprobs=1), "logprobs need a server without --speculate"),
])
def test_a_speculative_engine_refuses_what_its_step_would_ignore(request_kwargs, words):
    """The speculative step draws from the model's unchanged distribution and emits several
    tokens per step: penalties, bias and logprobs are refused there, never dropped."""
    from archlab.infer.speculative import SpeculativeOptions

    model = build_model(tiny_model_cfg(n_layers=4)).eval()
    engine = Engine(model, slots=1, speculate=SpeculativeOptions(2, 2))
    with pytest.raises(ValueError, match=words):
        Scheduler(engine).check(Request([1, 2], **request_kwargs))
