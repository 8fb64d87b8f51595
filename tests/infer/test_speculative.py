"""Self-speculative decoding (``infer.speculative``): greedy output is plain greedy decoding's for
every draft depth and length, alone and in ragged batches, up to the end of the context; sampled
tokens follow the full model's distribution (a chi-square test that a sampler which always accepts
the draft fails); rejected drafts leave nothing a later step reads; requests are independent of
their batch; unsupported models and bad values are refused with one line; ``generate``, ``serve``
and ``bench speculative`` end to end."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from archlab.config import make_config
from archlab.errors import UsageError
from archlab.infer.engine import Engine, Request
from archlab.infer.sampling import SamplingParams, sampling_probs
from archlab.infer.speculative import SelfSpeculative, SpeculativeOptions
from archlab.model import build_model
from tests.helpers import run_cli

V = 97
PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], [15, 16]]


def built(*overrides: str, layers: int = 4, vocab: int = V, std: float = 0.1, seed: int = 0):
    """A tiny model; ``init_std`` 0.1 makes every layer matter, so a shallow exit often disagrees
    with the full model (at the default 0.02 the first layer's argmax is nearly always the last's)."""
    torch.manual_seed(seed)
    cfg = make_config("tiny", overrides=[f"model.vocab_size={vocab}", "model.d_model=32", f"model.n_layers={layers}",
                                         "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64",
                                         "train.seq_len=32", f"model.init_std={std}", *overrides]).model
    return build_model(cfg).eval()


def greedy(model, prompts, lengths, options: SpeculativeOptions | None = None, max_len: int | None = None,
           **params):
    engine = Engine(model, slots=len(prompts), max_len=max_len, speculate=options)
    requests = engine.generate(prompts, [SamplingParams(max_new_tokens=n, temperature=0, **params) for n in lengths])
    return [r.tokens for r in requests], engine


MODELS = {
    "baseline": [],
    "looped": ["model.n_layers=3", "model.schedule=looped", "model.looped.prelude=1"],
    "variable-width": ["model.width=variable", "model.variable_width.multiple_of=16"],
    "moe": ["model.ffn=moe", "model.moe.n_experts=4"],
    "discoloop": ["model.n_layers=2", "model.schedule=looped", "model.tie_embeddings=true",
                  "model.looped.channel=disco"],
    "layer-dropout": ["model.schedule=layer_dropout", "model.layer_dropout.p_max=0.5"],
}


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_equals_plain_greedy_for_every_exit_and_draft_length(name):
    """A ragged batch of four (and, for the baseline, one prompt alone) for every exit and K."""
    model = built(*MODELS[name])
    lengths = [14, 9, 17, 5]
    plain, _ = greedy(model, PROMPTS, lengths)
    alone = greedy(model, PROMPTS[2:3], lengths[2:3])[0] if name == "baseline" else None
    drafted = accepted = 0
    exits = [n for n in model.exit_points if n < len(model.visits)]
    assert exits
    for k in exits:
        for K in (1, 2, 4):
            got, engine = greedy(model, PROMPTS, lengths, SpeculativeOptions(K, k))
            assert got == plain, (k, K)
            if alone is not None:
                assert greedy(model, PROMPTS[2:3], lengths[2:3], SpeculativeOptions(K, k))[0] == alone, (k, K)
            drafted += engine.speculative.stats.drafted
            accepted += engine.speculative.stats.accepted
    assert 0 < accepted < drafted / 2  # the shallow exits disagree often, and not always


def agreeing(model, exit_after: int):
    """``model`` with every layer after ``exit_after`` adding nothing (zero output projections):
    its exit there is the full model."""
    with torch.no_grad():
        for block in model.layers[exit_after:]:
            block.attn.wo.weight.zero_()
            block.mlp.w_down.weight.zero_()
    return model


def test_a_draft_that_agrees_with_the_full_model_is_always_accepted():
    model = agreeing(built(), 2)
    plain, _ = greedy(model, PROMPTS, [16] * 4)
    got, engine = greedy(model, PROMPTS, [16] * 4, SpeculativeOptions(3, 2))
    s = engine.speculative.stats
    assert got == plain and s.accepted == s.drafted > 0 and s.acceptance == 1.0
    assert s.steps == 4 and s.tokens_per_step == 15 / 4  # 15 tokens after the prefill's: 3 steps of 4, one of 3
    engine = Engine(model, slots=2, speculate=SpeculativeOptions(3, 2))  # p == q: sampled drafts are kept too
    sampled = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=9, temperature=1.0, seed=3))
    assert sampled[0].tokens != plain[0][:9] and engine.speculative.stats.acceptance == 1.0


def assert_cache_holds(model, engine, slot: int, seq: list[int], upto: int) -> None:
    """Cache row ``slot`` holds, at positions ``< upto``, the keys/values of a fresh prefill of
    ``seq`` for every visit."""
    fresh = model.new_cache(1, model.cfg.max_seq_len)
    with torch.no_grad():
        model.prefill(torch.tensor([seq[:upto]]), fresh, torch.tensor([upto]))
    for visit in range(len(model.visits)):
        for mine, ref in zip(engine.cache.layer(visit), fresh.layer(visit)):
            torch.testing.assert_close(mine[slot, :, :upto], ref[0, :, :upto], rtol=0, atol=1e-5)


def test_requests_that_reach_the_end_of_the_context_decode_exactly():
    """A row near its end drafts with the batch past its context (into the scratch slot): its
    tokens, and those of a row that goes on, are plain greedy decoding's, and its cache holds the
    full model's keys/values up to its last position, at the model's last position and at an
    engine's shorter context."""
    model = built()
    for max_len, prompts, lengths in ((None, [list(range(1, 51)), [3, 4]], [14, 40]),
                                      (32, [list(range(1, 23)), [7]], [11, 30])):
        speculative, engine = greedy(model, prompts, lengths, SpeculativeOptions(4, 1), max_len=max_len)
        context = engine.max_len
        assert len(prompts[0]) + lengths[0] - 1 == context  # the first row fills its context
        plain, _ = greedy(model, prompts, lengths, max_len=context)
        assert speculative == plain and [len(t) for t in speculative] == lengths
        assert_cache_holds(model, engine, 0, prompts[0] + speculative[0], context)


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    model = agreeing(built(), 1)  # every draft is accepted: one step gives tokens 1..5
    plain, _ = greedy(model, PROMPTS[:1], [20])
    at = next(i for i in range(1, 5) if plain[0][i] not in plain[0][:i])
    got, engine = greedy(model, PROMPTS[:1], [20], SpeculativeOptions(4, 1), stop_tokens=(plain[0][at],))
    assert got[0] == plain[0][:at + 1]
    assert engine.speculative.stats.steps == 1 and engine.speculative.stats.accepted == 4


def test_sampling_is_seeded_and_independent_of_the_batch():
    model = built()
    spec = SpeculativeOptions(3, 2)
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=30, top_p=0.95, seed=7)
    alone = Engine(model, slots=1, speculate=spec).generate([[5, 6, 7]], sp)[0].tokens
    mixed = Engine(model, slots=3, speculate=spec).generate(
        [[1, 2], [5, 6, 7], [4]], [SamplingParams(max_new_tokens=5, temperature=0.6, seed=1), sp,
                                   SamplingParams(max_new_tokens=20, temperature=0)])
    assert mixed[1].tokens == alone and len(alone) == 12
    assert mixed[2].tokens == greedy(model, [[4]], [20])[0][0]  # a greedy row among sampled ones
    other = Engine(model, slots=1, speculate=spec).generate([[5, 6, 7]], SamplingParams(
        max_new_tokens=12, temperature=0.9, top_k=30, top_p=0.95, seed=8))[0].tokens
    assert other != alone


def test_a_request_that_drafts_nothing_samples_plain_decodings_tokens():
    """``speculate: 0`` for a request: each step's token comes from the full model with the
    request's own random numbers, as plain sampling draws it."""
    model = built()
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11)
    plain = Engine(model, slots=1).generate([[5, 6, 7]], params)[0].tokens
    engine = Engine(model, slots=1, speculate=SpeculativeOptions(4, 1))
    off = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=10, temperature=1.0, seed=11, speculate=0))
    assert off[0].tokens == plain and engine.speculative.stats.drafted == 0


# ---- the sampler's distribution ------------------------------------------------------------------
SMALL_V, DRAWS = 10, 4096
WARP = dict(temperature=0.9, top_k=8, top_p=0.97)  # applied to the draft's and the full model's alike


class AlwaysAccepts(SelfSpeculative):
    """A wrong sampler: keeps every draft token, so its tokens follow the draft's distribution."""

    @staticmethod
    def keeps(u, p_x, q_x):
        return torch.ones_like(u, dtype=torch.bool)


def first_two_tokens(model, sampler: type[SelfSpeculative], prefix: list[int], pending: int) -> torch.Tensor:
    """The two tokens after ``prefix + [pending]`` drawn by ``sampler`` (K = 2 drafted by the
    first visit) with seeds 0..DRAWS-1, all rows in one batch: [DRAWS, 2]."""
    options = SpeculativeOptions(draft_tokens=2, draft_layers=1)
    engine = Engine(model, slots=DRAWS, max_len=16, speculate=options)
    engine.speculative = sampler(engine, options)
    params = [SamplingParams(max_new_tokens=8, seed=i, **WARP) for i in range(DRAWS)]
    engine.prefill(list(range(DRAWS)), [prefix] * DRAWS, params)
    engine.tokens.fill_(pending)  # every row continues from the same token
    requests = {i: Request(prefix, params[i], tokens=[pending]) for i in range(DRAWS)}
    while any(len(r.tokens) < 3 for r in requests.values()):
        active = {s: r for s, r in requests.items() if len(r.tokens) < 3}
        for slot, tokens in engine.speculative.step(active).items():
            requests[slot].tokens += tokens
    return torch.tensor([r.tokens[1:3] for r in requests.values()])


def expected_pairs(model, prefix: list[int], pending: int) -> torch.Tensor:
    """P(x1, x2) [V, V] of the full model after ``prefix + [pending]``, under the warp."""
    seqs = torch.tensor([prefix + [pending, x1] for x1 in range(SMALL_V)])
    with torch.no_grad():
        logprobs = model.log_probs(model(seqs))
    warp = [torch.full((SMALL_V,), WARP["temperature"]), torch.full((SMALL_V,), WARP["top_k"]),
            torch.full((SMALL_V,), WARP["top_p"])]
    first = sampling_probs(logprobs[:, -2], *warp)[0].double()  # the same row for every x1
    second = sampling_probs(logprobs[:, -1], *warp).double()
    return first[:, None] * second


def chi_square_p(pairs: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of the counts of ``pairs`` against probabilities ``expected``: cells expecting
    fewer than 5 draws pooled; a draw where the probability is 0 gives 0."""
    counts = torch.bincount(pairs[:, 0] * SMALL_V + pairs[:, 1], minlength=SMALL_V ** 2).double()
    want = expected.flatten() * len(pairs)
    if counts[want == 0].sum() > 0:
        return 0.0
    big = want >= 5
    pooled = want[~big].sum() > 0
    observed = torch.cat([counts[big], counts[~big].sum()[None]]) if pooled else counts[big]
    predicted = torch.cat([want[big], want[~big].sum()[None]]) if pooled else want[big]
    predicted *= observed.sum() / predicted.sum()  # the float sum of the probabilities is 1 to rounding
    return float(stats.chisquare(observed.numpy(), predicted.numpy()).pvalue)


def test_sampled_tokens_follow_the_full_models_distribution():
    """4096 seeds from one prefix: the joint distribution of the next two tokens (drafts accepted,
    corrected and completed by the full model) is the full model's under the same temperature,
    top-k and top-p; a sampler that always accepts the draft is told apart."""
    model = built(vocab=SMALL_V, std=0.25, seed=3)
    prefix, pending = [1, 2, 3, 4, 5], 6
    expected = expected_pairs(model, prefix, pending)
    right = first_two_tokens(model, SelfSpeculative, prefix, pending)
    wrong = first_two_tokens(model, AlwaysAccepts, prefix, pending)
    assert chi_square_p(right, expected) > 0.01
    assert chi_square_p(wrong, expected) < 1e-6
    # the draft and the full model differ enough for the test to matter: many rejections
    engine = Engine(model, slots=64, speculate=SpeculativeOptions(2, 1))
    engine.generate([prefix] * 64, [SamplingParams(max_new_tokens=6, seed=i, **WARP) for i in range(64)])
    assert engine.speculative.stats.acceptance < 0.8


# ---- rollback ------------------------------------------------------------------------------------
def test_rejected_drafts_leave_no_trace():
    """After steps with rejections, each row's cache up to its position holds the full model's
    keys/values of the accepted sequence, and decoding on predicts what a fresh full forward over
    the accepted tokens predicts."""
    model = built()
    prompts = [[3, 4, 5, 6], [7, 8]]
    params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=5)
    engine = Engine(model, slots=2, speculate=SpeculativeOptions(4, 1))
    first, _ = engine.prefill([0, 1], prompts, [params, params])
    requests = {i: Request(p, params, tokens=[int(first[i])]) for i, p in enumerate(prompts)}
    spec = engine.speculative
    for _ in range(4):
        for slot, tokens in spec.step(requests).items():
            requests[slot].tokens += tokens
    assert spec.stats.accepted < spec.stats.drafted  # drafts were rejected
    continuation = [11, 12, 13, 14]
    for slot, r in requests.items():
        seq = r.prompt + r.tokens  # the last token is pending: fed by the next step
        pos = len(seq) - 1
        assert int(engine.positions[slot]) == pos
        assert_cache_holds(model, engine, slot, seq, pos)
        assert engine.cache.layer(0)[0][slot, :, pos].abs().sum() > 0  # a rejected draft's stale entry
        with torch.no_grad():
            ref = model.log_probs(model(torch.tensor([seq + continuation])))[0, pos:]
            rows = torch.tensor([slot])
            for j, token in enumerate([seq[-1], *continuation]):
                got = model.decode(torch.tensor([[token]]), engine.cache, torch.tensor([pos + j]), rows)
                torch.testing.assert_close(got[0], ref[j], rtol=0, atol=1e-5)


# ---- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,options,words", [
    (["model.branch.enabled=true"], SpeculativeOptions(2), "model.branch"),
    (["model.residual.kind=attnres"], SpeculativeOptions(2), "model.residual.kind=attnres"),
    (["model.residual.kind=delta"], SpeculativeOptions(2), "model.residual.kind=delta"),
    ([], SpeculativeOptions(0), "--speculate must be at least 1"),
    ([], SpeculativeOptions(2, 4), "--draft-layers must be an exit point before the last of the model's 4"),
    ([], SpeculativeOptions(2, 0), "one of 1, 2, 3; got 0"),
    (["model.n_layers=1"], SpeculativeOptions(2), "only exit follows its last layer visit"),
])
def test_unsupported_models_and_bad_values_are_one_line(overrides, options, words):
    model = built(*overrides)
    with pytest.raises(UsageError, match=words) as e:
        Engine(model, slots=1, speculate=options)
    assert "\n" not in str(e.value)


def test_a_draft_must_stop_where_the_width_is_the_final_one():
    model = built(*MODELS["variable-width"])
    narrow = next(n for n in range(1, len(model.visits)) if n not in model.exit_points)
    with pytest.raises(UsageError, match=f"got {narrow}"):
        Engine(model, slots=1, speculate=SpeculativeOptions(2, narrow))


def test_a_request_accepts_at_most_its_own_draft_limit():
    """Beside a row that accepts 4 drafts per step, a request asking for 1 gains 2 tokens per step
    (every draft agrees here): 4 steps for its 8 tokens after the prefill's."""
    model = agreeing(built(), 1)
    plain, _ = greedy(model, PROMPTS[:2], [9, 9])
    engine = Engine(model, slots=2, speculate=SpeculativeOptions(4, 1))
    requests = engine.generate(PROMPTS[:2], [SamplingParams(max_new_tokens=9, temperature=0, speculate=1),
                                             SamplingParams(max_new_tokens=9, temperature=0)])
    s = engine.speculative.stats
    assert [r.tokens for r in requests] == plain
    assert s.steps == 4 and s.drafted == s.accepted == (1 + 4) + (1 + 2) + 1 + 1


def test_a_requests_draft_limit_is_checked_against_the_engine():
    from archlab.infer.engine import Scheduler

    model = built()
    for engine, asked, words in ((Engine(model, slots=1, speculate=SpeculativeOptions(2)), 3, "at most 2"),
                                 (Engine(model, slots=1), 1, "needs an engine that speculates"),
                                 (Engine(model, slots=1, speculate=SpeculativeOptions(2)), -1, "must be >= 0")):
        with pytest.raises(ValueError, match=words):
            Scheduler(engine).submit(Request([1, 2], SamplingParams(max_new_tokens=4, speculate=asked)))


# ---- command line and server ---------------------------------------------------------------------
def test_generate_speculates_end_to_end(tiny_run, capsys):
    base = ("generate", "--ckpt", str(tiny_run), "--prompt", "def main(", "--prompt", "import os",
            "--max-new-tokens", "12", "--temperature", "0", "--device", "cpu")
    code, plain, _ = run_cli(capsys, *base)
    assert code == 0
    code, out, err = run_cli(capsys, *base, "--speculate", "3", "--draft-layers", "1")
    assert code == 0 and out == plain
    assert "speculative: 3 draft tokens per step from 1 of 2 layer visits: acceptance" in err


@pytest.mark.parametrize("args,words", [
    (("--speculate", "0"), "--speculate: must be at least 1"),
    (("--speculate", "2", "--draft-layers", "2"), "--draft-layers must be an exit point before the last"),
    (("--draft-layers", "1"), "give --speculate K too"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_speculation_values_are_one_line_and_exit_2(tiny_run, capsys, command, args, words):
    extra = ("--prompt", "x") if command == "generate" else ("--port", "1", "--no-warm-up")
    code, out, err = run_cli(capsys, command, "--ckpt", str(tiny_run), *extra, *args, "--device", "cpu")
    assert code == 2 and words in err
    assert len(err.strip().splitlines()) == 1 or "usage:" in err  # argparse adds its usage line


def test_bench_speculative_reports_acceptance_and_identical_greedy_tokens(tiny_run, capsys, tmp_path):
    import json

    code, out, err = run_cli(capsys, "bench", "speculative", "--ckpt", str(tiny_run), "--context", "8", "--steps",
                             "10", "--batches", "1,2", "--speculate", "2", "--device", "cpu", "--json",
                             str(tmp_path / "spec.json"))
    assert code == 0, err
    rows = json.loads((tmp_path / "spec.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["identical"] for r in rows)
    assert all(0 <= r["acceptance"] <= 1 and 1 <= r["tokens_per_step"] <= 3 for r in rows)
    assert "self-speculative decoding" in out
    code, _, err = run_cli(capsys, "bench", "decode", "--ckpt", str(tiny_run), "--speculate", "2")
    assert code == 2 and "applies to archlab bench speculative" in err


def test_the_server_speculates_and_refuses_a_bad_draft_limit(tiny_run):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import httpx

    from archlab.infer.loading import load_for_inference
    from tests.infer.test_server import expected, running_server

    model, tok, eos, _ = load_for_inference(tiny_run, "cpu", "float32")
    engine = Engine(model, slots=2, speculate=SpeculativeOptions(3, 1))
    with running_server(engine, tok, eos) as (loop, port):
        client = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=60)
        for body in ({}, {"speculate": 1}):
            out = client.completions.create(model="tiny", prompt="def main(", max_tokens=12, temperature=0,
                                            extra_body=body)
            assert out.choices[0].text == expected(model, tok, eos, "def main(", 12, temperature=0.0)
        assert engine.speculative.stats.steps > 0
        for value, words in ((4, "at most 3"), (-1, "must be >= 0"), ("two", "must be an integer")):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                           json={"model": "tiny", "prompt": "x", "speculate": value})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "speculate"


def test_drafts_on_the_decode_attention_kernel(monkeypatch):
    """The drafts' one-token steps on archlab's decode-attention kernel (CUDA's path; Triton's
    interpreter here), reading the cache rows of a running subset, give plain greedy's tokens."""
    pytest.importorskip("triton")
    from archlab.model.core import layers

    monkeypatch.setattr(layers, "DECODE_ATTENTION", "triton")
    model = built(layers=2)
    plain, _ = greedy(model, PROMPTS[:2], [6, 3])
    got, engine = greedy(model, PROMPTS[:2], [6, 3], SpeculativeOptions(2, 1))
    assert got == plain and engine.speculative.stats.accepted < engine.speculative.stats.drafted


def test_the_compiled_step_gives_the_eager_steps_tokens_and_never_recompiles():
    """The step runs every slot at fixed shapes, so ``torch.compile`` (what the CUDA graph
    captures) compiles it for the first greedy and the first sampled step and never again, however
    many drafts each row may accept; a free slot (three slots, two requests) changes nothing;
    greedy and sampled tokens equal the eager engine's."""
    from torch._dynamo.utils import counters

    model = built()
    options = SpeculativeOptions(3, 1)
    prompts = PROMPTS[:2]

    def greedy_params(a, b):
        return [SamplingParams(max_new_tokens=a, temperature=0), SamplingParams(max_new_tokens=b, temperature=0)]

    def sampled_params(n, *seeds):
        return [SamplingParams(max_new_tokens=n, temperature=1.0, seed=s) for s in seeds]

    def run(engine, plist):
        return [r.tokens for r in engine.generate(prompts, plist)]

    eager = Engine(model, slots=3, speculate=options, compile=False)
    compiled = Engine(model, slots=3, speculate=options, compile=True)
    for plist in (greedy_params(12, 7), sampled_params(10, 3, 4)):
        assert run(compiled, plist) == run(eager, plist)
    assert run(compiled, greedy_params(12, 7)) == greedy(model, prompts, [12, 7])[0]
    graphs = counters["stats"]["unique_graphs"]
    for plist in (greedy_params(5, 16), sampled_params(13, 8, 9)):  # other limits, seeds and lengths
        assert run(compiled, plist) == run(eager, plist)
    assert counters["stats"]["unique_graphs"] == graphs
    assert sorted(compiled.speculative._steps) == [False, True]
