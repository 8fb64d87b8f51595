"""``/v1/completions`` beyond one plain completion, through the official ``openai`` client:
``logprobs`` (OpenAI's legacy format) against the model's own log-softmax, ``echo`` with
``max_tokens`` 0 and 1 as lm-eval's ``local-completions`` sends it, ``n`` independent samples,
prompt lists (strings and token ids), streaming of all of these, the sampling penalties equal to
the engine's, ``/v1/models/{id}``; and lm-eval's own ``local-completions`` model against the
server when lm-eval is installed."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from archlab.eval.harness import Scorer  # noqa: E402
from archlab.infer.engine import Engine  # noqa: E402
from archlab.infer.loading import load_for_inference  # noqa: E402
from tests.infer.test_server import expected, running_server  # noqa: E402


@pytest.fixture(scope="module")
def served(tiny_run):
    model, tok, eos, _ = load_for_inference(tiny_run, "cpu", "float32")
    with running_server(Engine(model, slots=4), tok, eos) as (loop, port):
        client = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=60)
        yield client, model, tok, eos, port


def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The full forward's log-probabilities [T, V]: row t predicts token t + 1."""
    with torch.no_grad():
        return model.log_probs(model(torch.tensor([ids])))[0]


def test_logprobs_of_generated_tokens_are_the_models(served):
    client, model, tok, eos, _ = served
    prompt = "def main("
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    choice = out.choices[0]
    lp = choice.logprobs
    ids = tok.encode(prompt).ids
    generated = [t for t in Engine(model, slots=1).generate([ids], _greedy(6, eos))[0].tokens]
    ref = model_logprobs(model, ids + generated)
    want = [float(ref[len(ids) - 1 + i, t]) for i, t in enumerate(generated)]
    assert len(lp.token_logprobs) == len(generated) and lp.token_logprobs == pytest.approx(want, abs=1e-4)
    for i, (top, logprob) in enumerate(zip(lp.top_logprobs, lp.token_logprobs)):
        best = ref[len(ids) - 1 + i].topk(3).values.tolist()
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(best, abs=1e-4)
        assert max(top.values()) == pytest.approx(logprob, abs=1e-6)  # greedy: the chosen is the best
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in generated]
    # offsets into the prompt followed by the completion
    assert lp.text_offset == [len(prompt) + sum(map(len, lp.tokens[:i])) for i in range(len(generated))]


def _greedy(n: int, eos: int | None):
    from archlab.infer.sampling import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0, stop_tokens=(eos,) if eos is not None else ())


def test_echo_with_no_tokens_scores_the_prompt_as_local_completions_does(served):
    """What lm-eval's ``local-completions`` does for a log-likelihood (``echo=True, logprobs=1``,
    here with ``max_tokens=0``), with a batch of two token-id prompts."""
    client, model, tok, _, _ = served
    prompts = [tok.encode("import os\nimport sys").ids, tok.encode("class A(object):").ids]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=1,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 0
    for ids, choice in zip(prompts, out.choices):
        lp = choice.logprobs
        ref = model_logprobs(model, ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
        assert choice.text == tok.decode(ids) and "".join(lp.tokens) == choice.text
        assert lp.text_offset[0] == 0 and all(len(top) in (1, 2) for top in lp.top_logprobs[1:])


def test_echo_with_one_token_as_lm_eval_sends_it(served):
    """lm-eval 0.4's payload: ``max_tokens=1``; it sums ``token_logprobs[ctxlen:-1]`` (the last is
    the generated token) and calls a continuation greedy when each token is its top one."""
    client, model, tok, eos, _ = served
    context, continuation = tok.encode("def f(x):\n").ids, tok.encode("    return x").ids
    ids = context + continuation
    out = client.completions.create(model="tiny", prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1
    ref = model_logprobs(model, ids)
    score = sum(lp.token_logprobs[len(context):-1])
    want = sum(float(ref[i - 1, ids[i]]) for i in range(len(context), len(ids)))
    assert score == pytest.approx(want, abs=1e-4)
    greedy = all(t == max(top.values()) for t, top in zip(lp.token_logprobs[len(context):-1],
                                                          lp.top_logprobs[len(context):-1]))
    assert greedy == all(int(ref[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids)))
    assert lp.token_logprobs[-1] == pytest.approx(float(ref[-1].max()), abs=1e-4)  # the greedy next token


def test_n_samples_and_prompt_lists(served):
    """Two prompts x n = 2: choice i * n + j is prompt i's sample j, drawn with seed + j."""
    client, model, tok, eos, _ = served
    prompts = ["def f(", "import "]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, n=2, temperature=0.9, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        prompt, j = prompts[c.index // 2], c.index % 2
        assert c.text == expected(model, tok, eos, prompt, 8, temperature=0.9, seed=5 + j)
    assert out.choices[0].text != out.choices[1].text  # independent samples
    assert out.usage.prompt_tokens == sum(len(tok.encode(p).ids) for p in prompts)


def test_streaming_n_and_logprobs_give_the_plain_responses(served):
    client, *_ = served
    request = dict(model="tiny", prompt=["x = ", "def g("], max_tokens=7, n=2, temperature=0.8, seed=1, logprobs=2,
                   echo=True)
    whole = client.completions.create(**request)
    texts, tokens, logprobs = {}, {}, {}
    for chunk in client.completions.create(**request, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
                logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    for c in whole.choices:
        assert texts[c.index] == c.text and tokens[c.index] == c.logprobs.tokens
        assert logprobs[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=1e-6)


@pytest.mark.parametrize("sampling", [dict(temperature=0, frequency_penalty=1.5),
                                      dict(temperature=0.9, seed=3, presence_penalty=-1.0,
                                           logit_bias=((11, 5.0), (12, -100.0)))])
def test_penalties_and_bias_reach_the_engine(served, sampling):
    client, model, tok, eos, _ = served
    body = dict(sampling)
    if "logit_bias" in body:
        body["logit_bias"] = {str(t): b for t, b in body["logit_bias"]}
    out = client.completions.create(model="tiny", prompt="for i in", max_tokens=10, **body)
    assert out.choices[0].text == expected(model, tok, eos, "for i in", 10, **sampling)
    plain = {k: v for k, v in sampling.items() if k in ("temperature", "seed")}
    assert out.choices[0].text != expected(model, tok, eos, "for i in", 10, **plain)


def test_one_model_by_id(served):
    *_, port = served
    got = httpx.get(f"http://127.0.0.1:{port}/v1/models/tiny")
    assert got.status_code == 200 and got.json()["id"] == "tiny" and got.json()["object"] == "model"
    other = httpx.get(f"http://127.0.0.1:{port}/v1/models/gpt-4")
    assert other.status_code == 404
    assert other.json()["error"]["code"] == "model_not_found" and "gpt-4" in other.json()["error"]["message"]


@pytest.mark.parametrize("body,words", [
    ({"prompt": [[1, 2], "x"], "max_tokens": 2}, None),  # a mixed list is fine: one choice each
    ({"prompt": [[1, 2], [3, 99999]]}, "outside the vocabulary"),
    ({"prompt": [[]]}, "empty"),
    ({"prompt": "x", "echo": "yes"}, "echo must be"),
    ({"prompt": "x", "max_tokens": 0, "echo": True, "stream": True}, "cannot stream"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias keys"),
    ({"prompt": "x", "logit_bias": {"5": 200}}, "[-100, 100]"),
    ({"prompt": "x", "n": 0}, "n must be in"),
])
def test_malformed_completion_fields(served, body, words):
    *_, port = served
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "tiny", **body}, timeout=30)
    if words is None:
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    else:
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_lm_eval_local_completions_agrees_with_the_model(served, tmp_path):
    """lm-eval's own ``local-completions`` model against the running server: its log-likelihood
    of each (context, continuation) is the model's own sum of log-probabilities."""
    lm_eval_api = pytest.importorskip("lm_eval.api.instance")
    for extra in ("aiohttp", "tenacity", "requests", "tqdm", "transformers"):  # lm-eval[api]'s, and its tokenizer
        pytest.importorskip(extra, reason=f"lm-eval's API models need {extra} (pip install 'lm-eval[api]')")
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    client, model, tok, _, port = served
    folder = tmp_path / "tokenizer"  # the checkpoint's tokenizer, as transformers loads one
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    lm = LocalCompletionsAPI(base_url=f"http://127.0.0.1:{port}/v1/completions", model="tiny",
                             tokenizer_backend="huggingface", tokenizer=str(folder), tokenized_requests=True,
                             max_length=64)
    # pairs whose tokens are the same encoded apart or together, so that any split agrees
    pairs = [("import", " os"), ("def main", "():"), ("for x in", " range(10)")]
    for context, continuation in pairs:
        assert tok.encode(context + continuation).ids == tok.encode(context).ids + tok.encode(continuation).ids
    requests = [lm_eval_api.Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(requests)
    own = Scorer(model, tok)(pairs)  # archlab's evaluator
    for (score, greedy), mine in zip(got, own):
        assert math.isfinite(score) and score == pytest.approx(mine.logprob, abs=1e-4) and greedy == mine.greedy


def test_score_only_requests_count_in_metrics(served):
    *_, port = served
    before = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                   json={"model": "tiny", "prompt": "x = 1", "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200 and json.loads(r.text)["choices"][0]["finish_reason"] == "length"
    after = httpx.get(f"http://127.0.0.1:{port}/metrics").text

    def length_count(text: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith('archlab_requests_total{outcome="length"}'))

    assert length_count(after) == length_count(before) + 1
