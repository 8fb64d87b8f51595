"""The OpenAI request bodies the server takes, checked before anything reaches the engine: a
malformed one is a ``BadRequest`` (a 4xx with OpenAI's error body), never a traceback.

    POST /v1/completions       prompt: a string, a list of token ids, or a list of either
                               (one choice per prompt x n); logprobs (0..20), echo, n, best_of
    POST /v1/chat/completions  messages (``infer.chat``), logprobs (bool) and top_logprobs

Both take model, max_tokens, temperature, top_p, stop, seed, stream, stream_options, n,
presence_penalty, frequency_penalty and logit_bias, and archlab's extras top_k and speculate.
Every parameter the server accepts changes what it does; a known one it cannot honour
(``UNSUPPORTED``) is refused with a 400 naming it, rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from archlab.infer.logprobs import MAX_TOP_LOGPROBS
from archlab.infer.sampling import SamplingParams


class BadRequest(Exception):
    """A request answered with a 4xx and an OpenAI-style error before it reaches the engine."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.kind, self.headers = kind, headers


#: parameters of OpenAI's or vLLM's API that the server does not implement, with the value that
#: means "off" (accepted, since it asks for nothing); any other value is a 400
UNSUPPORTED: dict[str, Any] = {"suffix": None, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0,
                               "use_beam_search": False, "ignore_eos": False, "length_penalty": 1,
                               "tools": None, "tool_choice": None, "functions": None, "function_call": None,
                               "guided_json": None, "guided_regex": None, "guided_choice": None}


@dataclass(frozen=True)
class Generation:
    """What one completions or chat request asks of the engine: ``n`` choices per prompt, choice
    ``j`` sampled with seed ``params.seed + j`` (independent samples; a seeded request repeats)."""

    prompts: list[list[int]]
    params: SamplingParams
    stops: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per token, or None: no logprobs
    echo: bool = False  # completions: the prompt (and its logprobs) before each choice's text
    prompt_texts: tuple[str, ...] = ()  # completions with echo: each prompt's text
    generates: bool = True  # False: max_tokens 0 with echo, the prompt scored and nothing generated

    def choice_params(self, j: int) -> SamplingParams:
        return replace(self.params, seed=self.params.seed + j)


def check_model(body: Any, model_name: str) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required: the id of a model from /v1/models", "model")
    if model != model_name:
        raise BadRequest(f"the model {model!r} does not exist; this server serves {model_name!r}", "model", 404,
                         "model_not_found")
    for key, off in UNSUPPORTED.items():
        if body.get(key) is not None and body[key] != off and body[key] != []:
            raise BadRequest(f"{key} is not supported by this server", key)


def number(body: dict, key: str, default: Any, kind: type) -> Any:
    """``body[key]`` as an int or a float (a float with an integer value counts as an int)."""
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise BadRequest(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}", key)
    return kind(value)


def logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object from token ids (as strings, JSON's keys) to a bias."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise BadRequest("logit_bias must be an object mapping token ids to a bias in [-100, 100]", "logit_bias")
    pairs = []
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab:
            raise BadRequest(f"logit_bias names token {token}, outside the vocabulary of {vocab}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"logit_bias values must be numbers, got {value!r}", "logit_bias")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def sampling(body: dict, stop_tokens: tuple[int, ...], vocab: int, max_tokens: int,
             lowest_max_tokens: int = 1) -> tuple[SamplingParams, tuple[str, ...], int, bool, bool]:
    """(sampling parameters, stop strings, n, stream, include_usage) from the fields both
    endpoints share; ``max_tokens``: the default. ``lowest_max_tokens`` 0 lets ``echo`` score a
    prompt without generating."""
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise BadRequest("stop must be a string or a list of up to 4 non-empty strings", "stop")
    n = number(body, "n", 1, int)
    if not 1 <= n <= 128:
        raise BadRequest(f"n must be in 1..128, got {n}", "n")
    best_of = number(body, "best_of", None, int)
    if best_of is not None and best_of != n:
        # Picking the best of several samples by their likelihood is not implemented: refused
        # rather than answered with n samples that were not chosen.
        raise BadRequest(f"best_of must equal n ({n}): choosing among extra samples is not supported", "best_of")
    limit = number(body, "max_tokens", max_tokens, int)
    params = SamplingParams(max_new_tokens=max(limit, 1), temperature=number(body, "temperature", 1.0, float),
                            top_k=number(body, "top_k", 0, int), top_p=number(body, "top_p", 1.0, float),
                            stop_tokens=stop_tokens, seed=number(body, "seed", 0, int),
                            speculate=number(body, "speculate", None, int),
                            presence_penalty=number(body, "presence_penalty", 0.0, float),
                            frequency_penalty=number(body, "frequency_penalty", 0.0, float),
                            logit_bias=logit_bias(body, vocab))
    if limit < lowest_max_tokens:
        raise BadRequest(f"max_tokens must be >= {lowest_max_tokens}, got {limit}", "max_tokens")
    try:
        params.check()
    except ValueError as e:
        raise BadRequest(str(e), str(e).split()[0]) from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)):
        raise BadRequest("stream_options must be an object like {\"include_usage\": true}", "stream_options")
    return params, stops, n, stream, bool(options and options.get("include_usage"))


def _token_ids(prompt: list, vocab: int) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise BadRequest("a prompt must be a string or a list of token ids", "prompt")
    if any(t < 0 or t >= vocab for t in prompt):
        raise BadRequest("a prompt token id is outside the vocabulary", "prompt")
    return list(prompt)


def parse_completion(body: Any, model_name: str, tokenizer, eos: int | None) -> Generation:
    """A ``/v1/completions`` body as a ``Generation``, or ``BadRequest``."""
    check_model(body, model_name)
    vocab = tokenizer.get_vocab_size()
    prompt = body.get("prompt")
    # One prompt is a string or a list of ids; a batch is a list of strings or of id lists.
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list))):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")
    prompts, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            ids = tokenizer.encode(p).ids if p else []
            texts.append(p)
        elif isinstance(p, list):
            ids = _token_ids(p, vocab)
            texts.append(tokenizer.decode(ids, skip_special_tokens=False))
        else:
            raise BadRequest("prompt must be a string, a list of token ids, or a list of either", "prompt")
        if not ids:
            raise BadRequest("the prompt is empty", "prompt")
        prompts.append(ids)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest("echo must be true or false", "echo")
    logprobs = number(body, "logprobs", None, int)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {logprobs}", "logprobs")
    params, stops, n, stream, usage = sampling(body, (eos,) if eos is not None else (), vocab, 16,
                                               lowest_max_tokens=0 if echo else 1)
    if body.get("max_tokens") == 0 and stream:
        raise BadRequest("max_tokens 0 (scoring the prompt with echo) cannot stream", "stream")
    return Generation(prompts, params, stops, n, stream, usage, logprobs, echo, tuple(texts) if echo else (),
                      generates=number(body, "max_tokens", 16, int) != 0)
