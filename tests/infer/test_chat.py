"""Chat: the checkpoint's ``chat_template.jinja`` rendered in Jinja's sandbox (special tokens
encoded as themselves, no BOS added twice, the end-of-turn token found and made a stop token,
the template's own refusals and a sandbox escape both 400s), and ``/v1/chat/completions``
through the ``openai`` client: plain, streaming in OpenAI's chunk format, n > 1 and logprobs,
each equal to the engine's generation from the rendered prompt; a model without a template gets
a clear 400."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from archlab.errors import CheckpointError
from archlab.infer.chat import TEMPLATE_FILE, ChatTemplate, load_chat_template, parse_chat, parse_messages
from archlab.infer.openai_api import BadRequest

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def word_tokenizer():
    """A word-level tokenizer with ChatML's special tokens and a post-processor that adds BOS
    (as Llama's tokenizer.json does), so a second BOS would show."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<unk>", "<s>", "</s>", "user", "assistant", "system", "hi", "there", "be", "brief"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.encode_special_tokens = True  # as archlab's loader sets it: text never forges a special token
    return tok


def test_chatml_renders_to_special_tokens_and_stops_at_the_end_of_turn():
    tok = word_tokenizer()
    template = ChatTemplate(CHATML, tok, eos=2)
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert template.render(messages).endswith("<|im_start|>assistant\n")
    assert template.prompt_ids(messages) == [start, 5, 8, 9, end, start, 3, 6, 7, end, start, 4]
    assert template.end_of_turn == end and template.stop_tokens == (2, end)
    assert tok.encode_special_tokens  # set back after rendering
    gen = parse_chat({"model": "m", "messages": messages, "max_tokens": 3}, "m", template, max_len=64)
    assert gen.prompts == [template.prompt_ids(messages)] and gen.params.stop_tokens == (2, end)


def test_bos_and_eos_come_from_the_checkpoint(tmp_path):
    tok = word_tokenizer()
    assert load_chat_template(tmp_path, tok, 2) is None
    (tmp_path / TEMPLATE_FILE).write_text("{{ bos_token }}{% for m in messages %}{{ m.content }} {{ eos_token }}"
                                          "{% endfor %}")
    (tmp_path / "state.json").write_text('{"special_tokens": {"bos_token": "<s>", "eos_token": "</s>"}}')
    template = load_chat_template(tmp_path, tok, 2)
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>hi </s>"
    assert template.prompt_ids([{"role": "user", "content": "hi"}]) == [1, 6, 2]
    assert template.end_of_turn == 2  # the eos token after each turn


@pytest.mark.parametrize("source,words", [
    ("{% if messages[0].role != 'user' %}{{ raise_exception('roles must start with user') }}{% endif %}",
     "roles must start with user"),
    ("{{ messages.__class__.__mro__ }}", "refused"),  # the sandbox keeps Python's internals out of reach
    ("{{ messages.append(1) }}", "refused"),  # and the request's objects immutable
])
def test_a_template_refusing_or_escaping_is_a_400(source, words):
    template = ChatTemplate(source, word_tokenizer(), eos=2)
    with pytest.raises(BadRequest, match=words) as e:
        template.render([{"role": "system", "content": "hi"}])
    assert e.value.status == 400 and e.value.param == "messages"


def test_a_broken_template_fails_at_load_in_one_line(tmp_path):
    (tmp_path / TEMPLATE_FILE).write_text("{% for m in messages %}")
    with pytest.raises(CheckpointError, match="not a valid Jinja template"):
        load_chat_template(tmp_path, word_tokenizer(), 2)


def test_messages_text_parts_and_refusals():
    got = parse_messages({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]},
                                       {"role": "assistant", "content": None}]})
    assert got == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]
    for bad, words in [({"messages": []}, "non-empty"),
                       ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                        "only text"),
                       ({"messages": [{"content": "x"}]}, "role")]:
        with pytest.raises(BadRequest, match=words):
            parse_messages(bad)


# ---- the endpoint --------------------------------------------------------------------------------

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from archlab.infer.engine import Engine  # noqa: E402
from archlab.infer.loading import load_for_inference  # noqa: E402
from archlab.infer.sampling import SamplingParams  # noqa: E402
from tests.infer.test_server import running_server  # noqa: E402

# The tiny checkpoint's tokenizer has one special token, <|endoftext|>: the template ends turns with it.
PLAIN = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def chat_served(tiny_run):
    model, tok, eos, _ = load_for_inference(tiny_run, "cpu", "float32")
    template = ChatTemplate(PLAIN, tok, eos)
    with running_server(Engine(model, slots=4), tok, eos, chat_template=template) as (_, port):
        client = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=60)
        yield client, model, tok, template


def engine_reply(model, tok, template, max_tokens: int, **sampling) -> tuple[str, list[int]]:
    params = SamplingParams(max_new_tokens=max_tokens, stop_tokens=template.stop_tokens, **sampling)
    tokens = Engine(model, slots=1).generate([template.prompt_ids(MESSAGES)], params)[0].tokens
    return tok.decode([t for t in tokens if t not in template.stop_tokens]), tokens


def test_chat_completion_is_the_engines_reply_to_the_rendered_prompt(chat_served):
    client, model, tok, template = chat_served
    assert template.end_of_turn == template.eos  # PLAIN ends a turn with <|endoftext|>
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == engine_reply(model, tok, template, 12, temperature=0.0)[0]
    assert out.usage.prompt_tokens == len(template.prompt_ids(MESSAGES))


def test_streaming_chat_uses_openais_chunks(chat_served):
    client, model, tok, template = chat_served
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0.8,
                                                 seed=2, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    body = [c for c in chunks if c.choices]
    assert body[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == engine_reply(model, tok, template, 10, temperature=0.8, seed=2)[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_chat_n_and_logprobs(chat_served):
    client, model, tok, template = chat_served
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.9, seed=7, n=2,
                                         logprobs=True, top_logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    ids = template.prompt_ids(MESSAGES)
    for c in out.choices:
        text, tokens = engine_reply(model, tok, template, 6, temperature=0.9, seed=7 + c.index)
        assert c.message.content == text
        content = c.logprobs.content
        assert len(content) == len(tokens) and all(len(item.top_logprobs) == 2 for item in content)
        with torch.no_grad():
            ref = model.log_probs(model(torch.tensor([ids + tokens])))[0]
        want = [float(ref[len(ids) - 1 + i, t]) for i, t in enumerate(tokens)]
        assert [item.logprob for item in content] == pytest.approx(want, abs=1e-4)


def test_chat_refusals(chat_served, tiny_run):
    client, *_ = chat_served
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        client.chat.completions.create(model="tiny", messages=MESSAGES,
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    model, tok, eos, _ = load_for_inference(tiny_run, "cpu", "float32")
    with running_server(Engine(model, slots=1), tok, eos) as (_, port):  # no chat template
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       json={"model": "tiny", "messages": MESSAGES}, timeout=30)
        assert r.status_code == 400 and "this model has no chat template" in r.json()["error"]["message"]


def test_lm_eval_local_chat_completions_gets_the_engines_reply(chat_served):
    """lm-eval's own ``local-chat-completions`` model (``generate_until`` as ``--apply_chat_template``
    sends it: the messages as JSON, greedy, stop strings, a seed) against the running server: its
    text is the engine's greedy reply to the rendered prompt, cut at the stop string."""
    instance = pytest.importorskip("lm_eval.api.instance")
    for extra in ("aiohttp", "tenacity"):  # lm-eval[api]'s
        pytest.importorskip(extra, reason=f"lm-eval's API models need {extra} (pip install 'lm-eval[api]')")
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion

    client, model, tok, template = chat_served
    lm = LocalChatCompletion(base_url=f"{client.base_url}chat/completions", model="tiny", max_gen_toks=12)
    reply = engine_reply(model, tok, template, 12, temperature=0.0)[0]
    stop = reply[len(reply) // 2:][:3] or "\n\n"  # a stop string inside the reply: the text ends before it
    requests = [instance.Instance("generate_until", {}, (JsonChatStr(json.dumps(MESSAGES)),
                                                         {"until": [stop], "max_gen_toks": 12, "temperature": 0}), 0),
                instance.Instance("generate_until", {}, (JsonChatStr(json.dumps(MESSAGES)),
                                                         {"until": ["<never>"], "max_gen_toks": 12}), 1)]
    got = lm.generate_until(requests, disable_tqdm=True)
    assert got == [reply[:reply.index(stop)], reply]
