"""The server's pipelined steps (``Scheduler.step_once(pipelined=True)``): a step is launched
before the previous step's tokens are handed out. Requests that arrive, finish, stop and are
cancelled at any step get exactly the tokens of sequential generation; a slot freed and refilled
while a step is in flight never gives its new request the old one's token."""

from __future__ import annotations

import pytest
import torch

from archlab.infer.engine import Engine, Request, Scheduler
from archlab.infer.sampling import SamplingParams
from archlab.model import build_model
from tests.helpers import tiny_model_cfg


def _model():
    torch.manual_seed(4)
    return build_model(tiny_model_cfg()).eval()


def _alone(model, prompt: list[int], params: SamplingParams) -> list[int]:
    return Engine(model, slots=1).generate([prompt], params)[0].tokens


def _serve(model, slots: int, arrivals: list[tuple[int, Request]], pipelined: bool,
           cancel_at: dict[int, int] | None = None) -> list[list[tuple[int, int]]]:
    """Drive a scheduler as ``EngineLoop`` does: at loop iteration ``k`` the requests arriving
    then join the queue; (iteration, token) as each request's callback saw them."""
    cancel_at = cancel_at or {}
    sched = Scheduler(Engine(model, slots=slots))
    seen: list[list[tuple[int, int]]] = [[] for _ in arrivals]
    k = 0
    for i, (_, r) in enumerate(arrivals):
        r.on_token = lambda r_, t, i=i: seen[i].append((k, t))
    while k < 1000:
        for i, (at, r) in enumerate(arrivals):
            if at == k:
                sched.submit(r)
            if cancel_at.get(i) == k:
                r.cancelled = True
        if k > max(at for at, _ in arrivals) and sched.idle:
            break
        sched.admit()
        if sched.busy:
            sched.step_once(pipelined=pipelined)
        k += 1
    assert sched.idle and sched.pending is None
    return seen


def _requests(stop: int | None = None) -> list[tuple[int, Request]]:
    """Eight requests arriving over 12 iterations, more than the slots: greedy, sampled,
    penalised, with a stop token; different prompt and generation lengths."""
    stops = (stop,) if stop is not None else ()
    specs = [
        (0, [5, 6, 7], SamplingParams(max_new_tokens=9, temperature=0)),
        (0, [8], SamplingParams(max_new_tokens=3, temperature=0.9, seed=1)),
        (1, [9, 10, 11, 12], SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, seed=2)),
        (2, [13, 14], SamplingParams(max_new_tokens=1, temperature=0)),
        (3, [15] * 7, SamplingParams(max_new_tokens=7, temperature=0.8, presence_penalty=0.5,
                                      frequency_penalty=0.3, seed=3)),
        (5, [16, 17], SamplingParams(max_new_tokens=10, temperature=0, stop_tokens=stops)),
        (8, [18], SamplingParams(max_new_tokens=5, temperature=1.2, top_p=0.8, seed=4)),
        (12, [19, 20, 21], SamplingParams(max_new_tokens=6, temperature=0, logit_bias=((3, 2.0),))),
    ]
    return [(at, Request(p, sp)) for at, p, sp in specs]


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_pipelined_steps_give_every_request_its_sequential_tokens(slots):
    model = _model()
    stop = _alone(model, [16, 17], SamplingParams(max_new_tokens=10, temperature=0))[3]
    arrivals = _requests(stop)
    seen = _serve(model, slots, arrivals, pipelined=True)
    for (_, r), got in zip(arrivals, seen):
        want = _alone(model, r.prompt, r.params)
        assert r.tokens == want and [t for _, t in got] == want
        assert r.finish_reason == ("stop" if stop in r.params.stop_tokens and stop in want else "length")


def test_pipelined_and_unpipelined_loops_agree_token_for_token():
    model = _model()
    a, b = _requests(), _requests()
    _serve(model, 3, a, pipelined=True)
    _serve(model, 3, b, pipelined=False)
    assert [r.tokens for _, r in a] == [r.tokens for _, r in b]


def test_a_step_in_flight_never_hands_a_refilled_slot_the_old_requests_token():
    """One slot: each request finishes while the next step for it is already launched; the
    next request is prefilled into the same slot before that step's tokens are handed out."""
    model = _model()
    arrivals = [(0, Request([5, 6], SamplingParams(max_new_tokens=n, temperature=0))) for n in (2, 3, 2)]
    seen = _serve(model, 1, arrivals, pipelined=True)
    for (_, r), got in zip(arrivals, seen):
        assert r.tokens == _alone(model, r.prompt, r.params) and len(got) == r.params.max_new_tokens


def test_a_request_cancelled_mid_stream_gets_no_token_after_its_cancellation_is_seen():
    model = _model()
    arrivals = _requests()
    seen = _serve(model, 4, arrivals, pipelined=True, cancel_at={2: 4})
    r = arrivals[2][1]
    assert r.finish_reason == "cancelled"
    assert r.tokens == _alone(model, r.prompt, r.params)[:len(r.tokens)] and len(r.tokens) < r.params.max_new_tokens
    assert all(k <= 5 for k, _ in seen[2])  # the step launched before the cancellation was seen, at most
    for i, (_, other) in enumerate(arrivals):
        if i != 2:
            assert other.tokens == _alone(model, other.prompt, other.params)


def test_logprobs_requests_step_unpipelined_after_the_pending_tokens():
    """A request asking for logprobs needs its step's rows at once: the scheduler hands out the
    pending step's tokens first, so every stream still gets its tokens in order."""
    model = _model()
    arrivals = _requests()
    lp = Request([22, 23], SamplingParams(max_new_tokens=4, temperature=0), top_logprobs=2)
    arrivals.insert(3, (4, lp))
    _serve(model, 3, arrivals, pipelined=True)
    for _, r in arrivals:
        assert r.tokens == _alone(model, r.prompt, r.params)
    assert len(lp.logprobs) == 4
