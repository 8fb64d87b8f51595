"""Fixtures for the evaluation tests: a real sentence from the standard library (the opening of
the ``collections`` module's docstring) and a tiny archlab model that has memorised it, so that
its answers to questions about the sentence are known."""

from __future__ import annotations

import collections
import inspect

import pytest
import torch


def stdlib_sentence() -> str:
    """"This module implements specialized container datatypes providing alternatives to
    Python's general purpose built-in containers, dict, list, set, and tuple." (22 words)."""
    text = " ".join(inspect.getdoc(collections).split("\n\n")[0].split())
    assert text.startswith("This module implements") and text.endswith("tuple."), text
    return text


@pytest.fixture(scope="session")
def sentence() -> str:
    return stdlib_sentence()


@pytest.fixture(scope="session")
def words(sentence) -> list[str]:
    return sentence.split(" ")


@pytest.fixture(scope="session")
def tokenizer(sentence, tmp_path_factory):
    """A byte-level BPE with a few merges (the sentence is 54 tokens: most words take several),
    saved and reloaded the way checkpoints load theirs."""
    from archlab.data.tokenizer import load_tokenizer, save_tokenizer, train_bpe

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_tokenizer(train_bpe([sentence], 330), path)
    return load_tokenizer(path)


@pytest.fixture(scope="session")
def trained_model(sentence, tokenizer):
    """A 2-layer model trained (150 steps, about 1.5 s) on the sentence repeated between
    ``<|endoftext|>`` tokens, until its loss is about 0.01: it continues any prefix greedily."""
    from archlab.model.config import ModelConfig
    from archlab.model import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only loses time to thread hand-offs
    try:
        torch.manual_seed(0)
        stream = torch.tensor(([0] + tokenizer.encode(sentence).ids) * 30)
        cfg = ModelConfig(vocab_size=tokenizer.get_vocab_size(), d_model=48, n_layers=2, n_heads=4, n_kv_heads=2,
                          max_seq_len=64)
        model = build_model(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        seq, batch = 48, 8
        gen = torch.Generator().manual_seed(0)
        for _ in range(150):
            starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
            x = torch.stack([stream[s:s + seq] for s in starts])
            y = torch.stack([stream[s + 1:s + seq + 1] for s in starts])
            loss = model(x, y).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 0.1, loss.item()
    return model.eval()


def mc_items(words: list[str]) -> list:
    """Which three words follow this prefix? The true ones, or three from elsewhere (gold varies)."""
    from archlab.eval.tasks import MCItem

    n = len(words) - 3
    items = []
    for k in range(2, n):
        true = " " + " ".join(words[k:k + 3])
        wrong = [" " + " ".join(words[(k + j) % n:(k + j) % n + 3]) for j in (5, 9)]
        gold = k % 3
        items.append(MCItem(" ".join(words[:k]), tuple(wrong[:gold] + [true] + wrong[gold:]), gold))
    return items


def lambada_items(words: list[str], shift: int = 0) -> list:
    """The sentence cut before word k; target word k (``shift`` > 0: a wrong word)."""
    from archlab.eval.tasks import LambadaItem

    return [LambadaItem(" ".join(words[:k]), words[(k + shift) % len(words)]) for k in range(3, len(words))]
