"""The engine: cached prefill and decode reproduce the full forward for ragged batches in any
slots; greedy equals uncached greedy; sampling is per row, seeded and batch-independent; stops,
limits and continuous batching through fewer slots than requests."""

from __future__ import annotations

import pytest
import torch

from archlab.infer.engine import Engine, Request, Scheduler, _group_plan, bucket
from archlab.infer.sampling import SamplingParams, sample, token_keys, uniforms
from archlab.model import build_model
from archlab.model.config import ModelConfig
from tests.helpers import tiny_model_cfg
from tests.infer.test_generate import assert_matches_full_forward


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_cached_decoding_matches_full_forward_ragged_batch(kv_heads):
    torch.manual_seed(1)
    model = build_model(tiny_model_cfg(n_kv_heads=kv_heads)).eval()
    seqs = [torch.randint(1, 97, (n,)).tolist() for n in (12, 7, 15)]
    assert_matches_full_forward(model, seqs, prompt_lens=[5, 1, 9])


def uncached_greedy(model, prompt: list[int], n: int, stop: int | None = None) -> list[int]:
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            t = int(model.log_probs(model(torch.tensor([seq])))[0, -1].argmax())
            out.append(t)
            seq.append(t)
            if t == stop:
                break
    return out


@pytest.mark.parametrize("slots", [1, 2, 5])
def test_greedy_equals_uncached_greedy_through_any_number_of_slots(slots):
    """Five requests of different lengths through 1, 2 or 5 slots (continuous batching: a request
    joins when another leaves) give exactly the tokens of uncached greedy decoding."""
    torch.manual_seed(2)
    model = build_model(tiny_model_cfg()).eval()
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], [15, 16], [17] * 20]
    lengths = [6, 3, 9, 1, 4]
    reqs = Engine(model, slots=slots).generate(
        prompts, [SamplingParams(max_new_tokens=n, temperature=0) for n in lengths])
    for r, p, n in zip(reqs, prompts, lengths):
        assert r.tokens == uncached_greedy(model, p, n) and r.finish_reason == "length"


def test_sampling_is_seeded_and_independent_of_the_batch():
    torch.manual_seed(2)
    model = build_model(tiny_model_cfg()).eval()
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    alone = Engine(model, slots=1).generate([[5, 6, 7]], sp)[0].tokens
    mixed = Engine(model, slots=3).generate(
        [[1, 2], [5, 6, 7], [4]], [SamplingParams(max_new_tokens=4, temperature=0.7, seed=9), sp,
                                   SamplingParams(max_new_tokens=12, temperature=0)])
    assert mixed[1].tokens == alone and len(alone) == 10
    other = Engine(model, slots=1).generate([[5, 6, 7]], SamplingParams(max_new_tokens=10, temperature=1.0, seed=4))
    assert other[0].tokens != alone  # the seed matters


def test_stop_token_ends_its_row_only():
    torch.manual_seed(2)
    model = build_model(tiny_model_cfg()).eval()
    greedy = uncached_greedy(model, [5, 6, 7], 6)
    stop = greedy[2]
    reqs = Engine(model, slots=2).generate(
        [[5, 6, 7], [5, 6, 7]], [SamplingParams(max_new_tokens=6, temperature=0, stop_tokens=(stop,)),
                                 SamplingParams(max_new_tokens=6, temperature=0)])
    assert reqs[0].tokens == greedy[: greedy.index(stop) + 1] and reqs[0].finish_reason == "stop"
    assert reqs[1].tokens == greedy and reqs[1].finish_reason == "length"


def test_streaming_callback_sees_every_token_in_order():
    torch.manual_seed(2)
    model = build_model(tiny_model_cfg()).eval()
    seen: dict[int, list[int]] = {}
    reqs = Engine(model, slots=2).generate(
        [[5, 6], [7], [8, 9]], SamplingParams(max_new_tokens=5, temperature=0),
        on_token=lambda r, t: seen.setdefault(id(r), []).append(t))
    assert all(seen[id(r)] == r.tokens for r in reqs)


def test_prefill_buckets_are_powers_of_two():
    assert [bucket(n, 1024) for n in (1, 16, 17, 100, 1000, 1024)] == [16, 16, 32, 128, 1024, 1024]
    assert bucket(300, 256) == 256


def test_a_group_of_any_size_prefills_as_power_of_eight_groups_with_the_same_results():
    """Nine prompts admitted together run as a group of 8 and one of 1 (shortest first): only
    power-of-eight shapes are ever built (each compiled once on a GPU), and every row's first
    token and log-probabilities equal those of prefilling that prompt alone, in the caller's
    order."""
    torch.manual_seed(4)
    model = build_model(tiny_model_cfg()).eval()
    prompts = [torch.randint(1, 97, (n,)).tolist() for n in (9, 2, 30, 5, 17, 1, 12, 3, 7)]
    params = [SamplingParams(max_new_tokens=2, temperature=0.9, seed=i) for i in range(9)]
    engine = Engine(model, slots=10)
    tok, logprobs = engine.prefill([6, 0, 3, 1, 5, 2, 4, 8, 9], prompts, params)
    assert {n for n, _ in engine._prefills} == {8, 1}
    assert engine.group_sizes() == (1, 8)
    for i, p in enumerate(prompts):
        alone = Engine(model, slots=1)
        t1, lp1 = alone.prefill([0], [p], [params[i]])
        assert int(tok[i]) == int(t1[0])
        torch.testing.assert_close(logprobs[i], lp1[0], atol=1e-5, rtol=1e-5)
    # each slot continues from its own prompt
    assert engine.positions.tolist() == [2, 5, 1, 30, 12, 17, 9, 0, 3, 7]


def test_warm_up_of_the_group_sizes_builds_every_shape_any_admission_needs():
    """After ``warm_up(batch_sizes=group_sizes())`` no number of prompts admitted together, 1 up to
    every slot, builds a new prefill shape (each new shape compiles on a GPU, for seconds, in the
    middle of serving). With 64 slots the group sizes were (1, 64): a batch of 63 built a group
    of 8 while 64 streams waited."""
    model = build_model(tiny_model_cfg()).eval()
    engine = Engine(model, slots=64)
    assert engine.group_sizes() == (1, 8, 64)
    assert Engine(model, slots=4).group_sizes() == (1,) and Engine(model, slots=512).group_sizes() == (1, 8, 64, 512)
    engine.warm_up(buckets=(16,), batch_sizes=engine.group_sizes())
    warmed = set(engine._prefills)
    for n in (63, 13, 9, 64, 7, 1):
        engine.prefill(list(range(n)), [[1, 2, 3]] * n, [SamplingParams(max_new_tokens=2)] * n)
        assert set(engine._prefills) == warmed, n


def test_top_k_and_top_p_restrict_support():
    logprobs = torch.log_softmax(torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]), -1).repeat(2000, 1)
    n = logprobs.shape[0]

    def draw(temperature=1.0, top_k=0, top_p=1.0):
        return sample(logprobs, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p),
                      torch.arange(n), torch.zeros(n, dtype=torch.long))

    assert set(draw(top_k=2).tolist()) == {0, 1}
    p = torch.softmax(logprobs[0], -1)
    assert set(draw(top_p=float(p[0]) + 1e-3).tolist()) == {0, 1}  # just above p0: tokens 0 and 1
    assert set(draw(temperature=0.0).tolist()) == {0}
    # unrestricted sampling follows the distribution (2000 draws: within 4 standard errors)
    freq = torch.bincount(draw(), minlength=5).double() / n
    assert ((freq - p.double()).abs() < 4 * (p * (1 - p) / n).sqrt().double() + 1e-3).all()


def test_uniforms_are_a_function_of_seed_position_and_token():
    keys = token_keys(1000)
    u = uniforms(torch.tensor([1, 1, 2]), torch.tensor([5, 6, 5]), keys)
    assert ((u > 0) & (u < 1)).all()
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u[0], uniforms(torch.tensor([1]), torch.tensor([5]), keys)[0])
    assert abs(float(u.mean()) - 0.5) < 0.02


def test_bad_requests_are_refused_before_any_work():
    model = build_model(tiny_model_cfg(max_seq_len=16)).eval()
    sched = Scheduler(Engine(model, slots=1))
    for params, match in [(SamplingParams(max_new_tokens=10), "context of 16"),
                          (SamplingParams(max_new_tokens=0), "max_tokens"),
                          (SamplingParams(temperature=-1), "temperature"),
                          (SamplingParams(top_p=0), "top_p"), (SamplingParams(top_k=-3), "top_k")]:
        with pytest.raises(ValueError, match=match):
            sched.submit(Request([1] * 10, params))
    assert sched.idle


@pytest.mark.parametrize("n, sizes, plan", [
    (13, (1, 8), [(8, 8), (5, 8)]),
    (64, (1, 8, 64), [(64, 64)]),
    (35, (1, 8, 64), [(35, 64)]),
    (20, (1, 8, 64), [(8, 8), (8, 8), (4, 8)]),
    (3, (1, 8, 64), [(1, 1)] * 3),
    (9, (1, 8), [(8, 8), (1, 1)]),
    (6, (1,), [(1, 1)] * 6),
    (130, (1, 8, 64), [(64, 64), (64, 64), (1, 1), (1, 1)]),
])
def test_group_plan_pads_a_remainder_of_half_a_group_or_more(n, sizes, plan):
    assert _group_plan(n, sizes) == plan


@pytest.mark.parametrize("sizes", [(1,), (1, 8), (1, 8, 64)])
def test_group_plan_admits_every_request_in_captured_groups_at_most_doubled(sizes):
    for n in range(1, 2 * sizes[-1] + 3):
        plan = _group_plan(n, sizes)
        assert sum(real for real, _ in plan) == n
        assert all(size in sizes and size >= real and 2 * real >= size for real, size in plan), (n, plan)


PADDED_MODELS = {  # kinds whose prefill writes more than one cache row or runs rows apart
    "baseline": {},
    "decode-branch": dict(branch={"enabled": True, "n_branches": 2}),
    "hidden-decoding": dict(hidden_decoding={"enabled": True, "streams": 2}),
    "moe": dict(ffn="moe", moe={"n_experts": 4, "top_k": 2}),
    "looped": dict(n_layers=3, schedule="looped", looped={"prelude": 1, "loops": 2}),
}


@pytest.mark.parametrize("name", sorted(PADDED_MODELS))
def test_padded_prefill_group_equals_each_prompt_alone_and_leaves_other_slots_alone(name):
    """5 prompts admitted together run as one group of 8 (3 padding copies of the longest): each
    prompt's first token, log-probabilities, position and counts are those of its own prefill,
    slots outside the batch keep their state, and decoding on continues every slot as alone."""
    torch.manual_seed(5)
    tree = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    model = build_model(ModelConfig.from_dict({**tree, **PADDED_MODELS[name]}).validate()).eval()
    with torch.no_grad():  # zero-initialised couplings and gates too, so each one's use is tested
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompts = [torch.randint(1, 97, (n,)).tolist() for n in (4, 11, 2, 7, 9)]
    params = [SamplingParams(max_new_tokens=4, temperature=0.8, seed=10 + i) for i in range(5)]
    engine = Engine(model, slots=10)
    engine.positions[9] = 33
    engine.counts[9, 5] = 2.0
    tok, logprobs = engine.prefill([3, 0, 7, 1, 5], prompts, params)
    assert set(engine._prefills) == {(8, bucket(11, engine.max_len))}
    assert int(engine.positions[9]) == 33 and float(engine.counts[9].sum()) == 2.0
    for slot in (2, 4, 6, 8):
        assert int(engine.positions[slot]) == 0 and float(engine.counts[slot].sum()) == 0.0
    for i, (slot, p) in enumerate(zip([3, 0, 7, 1, 5], prompts)):
        alone = Engine(model, slots=1)
        t1, lp1 = alone.prefill([0], [p], [params[i]])
        assert int(tok[i]) == int(t1[0]) == int(engine.tokens[slot])
        torch.testing.assert_close(logprobs[i], lp1[0], atol=1e-5, rtol=1e-5)
        assert int(engine.positions[slot]) == len(p)
        assert float(engine.counts[slot].sum()) == 1.0 and float(engine.counts[slot, int(t1[0])]) == 1.0
    together = engine.generate(prompts, params)
    for i, p in enumerate(prompts):
        assert together[i].tokens == Engine(model, slots=1).generate([p], params[i])[0].tokens
