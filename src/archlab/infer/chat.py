"""Chat for ``/v1/chat/completions``: the checkpoint's chat template and the request's messages.

The template is the file ``chat_template.jinja`` in the checkpoint directory, beside
``tokenizer.json`` (``archlab import-hf`` writes it there from a Hugging Face checkpoint, and
records the source model's bos and eos tokens in ``state.json``: ``infer.loading``). It is
rendered as transformers renders it: Jinja2 in an immutable sandbox (a template is code from
whoever made the checkpoint: it may not touch the server's objects), ``trim_blocks`` and
``lstrip_blocks``, with ``messages``, ``add_generation_prompt=True``, ``bos_token``,
``eos_token`` and the ``raise_exception`` that templates call for a conversation they refuse
(which becomes a 400 with the template's message). The rendered text already holds every
special token, so it is encoded without adding any.

A reply ends at the end-of-text token and at the template's end-of-turn token, found by
rendering an assistant turn: the first token after its content, when it is one of the
tokenizer's added tokens (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from archlab.errors import CheckpointError
from archlab.infer.loading import CHAT_TEMPLATE_FILE as TEMPLATE_FILE
from archlab.infer.logprobs import MAX_TOP_LOGPROBS
from archlab.infer.openai_api import BadRequest, Generation, check_model, number, sampling

_PROBE = "\x00archlab-probe\x00"  # an assistant reply no template changes or could contain


class ChatTemplate:
    """A compiled chat template with the tokenizer it renders for."""

    def __init__(self, source: str, tokenizer, eos: int | None, bos_token: str = "", where: str = "the template"):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise CheckpointError(f"{where} is not a valid Jinja template: {e}") from None
        self.tokenizer, self.eos = tokenizer, eos
        self.bos_token = bos_token
        self.eos_token = tokenizer.id_to_token(eos) if eos is not None else ""
        self.end_of_turn = self._end_of_turn()

    def render(self, messages: list[dict[str, str]]) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                        eos_token=self.eos_token)
        except TemplateError as e:  # the template refused the conversation (roles out of order, ...)
            raise BadRequest(f"the chat template refused the messages: {e}", "messages") from None

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        # archlab's tokenizers encode special tokens' text as plain bytes (``encode_special_tokens``,
        # archlab.data.tokenizer), so that text can never forge one; a template's markers
        # (``<|im_start|>``) must be the special tokens themselves, as transformers'
        # ``apply_chat_template`` encodes them. The flag is the tokenizer object's, so it is set
        # back at once (encoding happens on the server's one event-loop thread).
        tok = self.tokenizer
        saved = tok.encode_special_tokens
        tok.encode_special_tokens = False
        try:
            return tok.encode(self.render(messages), add_special_tokens=False).ids
        finally:
            tok.encode_special_tokens = saved

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        return tuple(t for t in dict.fromkeys((self.eos, self.end_of_turn)) if t is not None)

    def _end_of_turn(self) -> int | None:
        try:
            text = self.template.render(messages=[{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": _PROBE}],
                                        add_generation_prompt=False, bos_token=self.bos_token,
                                        eos_token=self.eos_token)
        except Exception:  # a template that refuses this probe still renders requests; no extra stop
            return None
        after = text.partition(_PROBE)[2].lstrip()
        added = {tok.content: i for i, tok in self.tokenizer.get_added_tokens_decoder().items()}
        return next((i for content, i in added.items() if content and after.startswith(content)), None)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def load_chat_template(ckpt_dir: Path, tokenizer, eos: int | None) -> ChatTemplate | None:
    """The checkpoint's chat template, or None when it has none; its ``bos_token`` is the one
    the checkpoint records (``import-hf`` keeps the source model's), else none."""
    from archlab.infer.loading import chat_template, special_tokens

    source = chat_template(Path(ckpt_dir))
    if source is None:
        return None
    bos = special_tokens(Path(ckpt_dir), tokenizer)["bos_token"] or ""
    return ChatTemplate(source, tokenizer, eos, bos, where=str(Path(ckpt_dir) / TEMPLATE_FILE))


def _content(message: dict, i: int) -> str:
    """A message's text: a string, or a list of text parts (OpenAI's content parts) joined."""
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise BadRequest(f"messages[{i}]: only text content parts are supported", "messages")
        return "".join(p["text"] for p in content)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role and a content", "messages")
        out.append({"role": m["role"], "content": _content(m, i)})
    return out


def parse_chat(body: Any, model_name: str, template: ChatTemplate | None, max_len: int) -> Generation:
    """A ``/v1/chat/completions`` body as a ``Generation`` of one prompt, or ``BadRequest``.
    ``max_tokens`` (or ``max_completion_tokens``) defaults to what the context leaves."""
    check_model(body, model_name)
    if template is None:
        raise BadRequest("this model has no chat template (a chat_template.jinja file beside its tokenizer.json); "
                         "use /v1/completions", "messages")
    ids = template.prompt_ids(parse_messages(body))
    if not ids:
        raise BadRequest("the chat template rendered an empty prompt", "messages")
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    wants = body.get("logprobs", False)
    if not isinstance(wants, bool):
        raise BadRequest("logprobs must be true or false", "logprobs")
    top = number(body, "top_logprobs", 0 if wants else None, int)
    if top is not None and not wants:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
    format_ = body.get("response_format")
    if format_ is not None and format_ != {"type": "text"}:
        raise BadRequest("response_format other than {\"type\": \"text\"} is not supported", "response_format")
    params, stops, n, stream, usage = sampling(body, template.stop_tokens, template.tokenizer.get_vocab_size(),
                                               max(1, max_len - len(ids) + 1))
    return Generation([ids], params, stops, n, stream, usage, top)
