"""Log-probabilities for the OpenAI API's ``logprobs`` and ``echo``: per generated token (from the
engine's step, ``chosen_logprobs``), per prompt token (one full forward, ``prompt_logprobs``), and
the two response formats: the legacy completions object (tokens, token_logprobs, top_logprobs,
text_offset) and chat's ``content`` list.

The values are the model's own log-probabilities, before temperature, top-k/top-p, penalties or
logit bias (vLLM's default, and what a client scoring text with ``echo`` needs): the sampling
parameters change which token is drawn, not what the model predicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: the most alternatives a token may list (OpenAI's chat limit and vLLM's default; the legacy
#: completions API allowed 5)
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a response: its log-probability and the most likely tokens at its place."""

    token: int
    logprob: float | None  # None: a text's first token, which nothing before it predicts
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


def chosen_logprobs(logprobs: Tensor, tokens: Tensor, tops: list[int]) -> list[TokenLogprob]:
    """An entry per row of ``logprobs`` [n, V] for the row's token ``tokens`` [n], with the
    ``tops[i]`` most likely tokens; one transfer to the host for all rows."""
    lp = logprobs.float()
    chosen = lp.gather(1, tokens.long()[:, None])[:, 0].tolist()
    k = min(max(tops), lp.shape[-1])
    values, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprob(int(t), c, tuple(zip(i[:n], v[:n])))
            for t, c, i, v, n in zip(tokens.tolist(), chosen, ids, values, tops)]


@torch.no_grad()
def prompt_logprobs(model, ids: list[int], top: int) -> list[TokenLogprob]:
    """Every prompt token's log-probability given the tokens before it, from the model's full
    forward and readout (which the cached prefill and decode steps equal)."""
    idx = torch.tensor([ids], device=model.lm_head.weight.device)
    predicted = model.log_probs(model(idx))[0]  # row t predicts token t + 1
    return [TokenLogprob(ids[0], None)] + chosen_logprobs(predicted[:-1], idx[0, 1:], [top] * (len(ids) - 1))


def token_text(tokenizer, token: int) -> str:
    """A token's text as the responses show it: special tokens included (as vLLM shows them); a
    token holding part of a UTF-8 character reads as U+FFFD."""
    return tokenizer.decode([token], skip_special_tokens=False)


def legacy_logprobs(tokenizer, entries: list[TokenLogprob], offset: int = 0) -> dict:
    """The completions API's ``logprobs`` object for ``entries``. ``text_offset`` counts
    characters of the token texts from ``offset``, the length of the text before the first
    entry (the prompt's, when it is not echoed). ``top_logprobs`` holds the top tokens and the
    chosen one, as OpenAI's legacy API did ("up to logprobs + 1 elements"); two tokens with the
    same text share one key, a limit of the format."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        text = token_text(tokenizer, e.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e.logprob is None:
            tops.append(None)
        else:
            top = {token_text(tokenizer, t): lp for t, lp in e.top}
            top.setdefault(text, e.logprob)
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    """Chat's ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def item(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}
