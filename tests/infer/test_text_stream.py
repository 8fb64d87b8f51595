"""Incremental detokenisation in the server (``TextStream``): the text streamed token by token,
decoding a short window each time, equals what decoding the whole sequence every time gives
(the former implementation, kept here as the reference), for a byte-level BPE tokenizer and a
metaspace one, with multi-byte characters split across tokens and stop strings across tokens."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from archlab.infer.server import TextStream


class WholeText:
    """The former TextStream: the whole sequence decoded at every token."""

    def __init__(self, tokenizer, stops, eos):
        self.tokenizer, self.stops, self.eos = tokenizer, stops, eos
        self.ids, self.sent, self.stopped = [], "", False

    def add(self, token, final=False):
        if token != self.eos:
            self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            text, self.stopped = text[: min(cuts)], True
        elif not final:
            if text.endswith("\ufffd"):
                return ""
            hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - hold]
        delta, self.sent = text[len(self.sent):], text
        return delta


CORPUS = ["naïve café — déjà vu, 東京 and Zürich; ünïcödé everywhere.", "def parse(line):\n    return line",
          "Once upon a time, the end. The end? THE END!"] * 20


def byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def metaspace() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()  # drops the leading space of a text: what the window is for
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    return tok


def stream(cls, tok, ids, stops, eos=None):
    s = cls(tok, stops, eos)
    out = []
    for i, t in enumerate(ids):
        out.append(s.add(t, final=i == len(ids) - 1))
        if s.stopped:
            break
    return out, s.stopped


@pytest.mark.parametrize("make", [byte_level, metaspace])
@pytest.mark.parametrize("stops", [(), ("end",), ("é", "THE E", "\n    ")])
def test_streamed_text_equals_decoding_the_whole_sequence(make, stops):
    tok = make()
    rng = random.Random(0)
    texts = [tok.encode(t).ids for t in CORPUS[:3]]
    # real texts, and random ids (multi-byte characters cut at any token, stray bytes)
    cases = texts + [[rng.randrange(tok.get_vocab_size()) for _ in range(rng.randrange(1, 40))] for _ in range(60)]
    # bytes alone: runs of lone continuation and lead bytes, and characters cut between tokens
    singles = [i for i in range(tok.get_vocab_size()) if len(tok.decode([i]).encode()) <= 3
               and "\ufffd" in tok.decode([i])]
    cases += [[rng.choice(singles + texts[0][:8]) for _ in range(rng.randrange(1, 60))] for _ in range(60)]
    for ids in cases:
        got, stopped = stream(TextStream, tok, ids, stops)
        want, want_stopped = stream(WholeText, tok, ids, stops)
        assert "".join(got) == "".join(want) and stopped == want_stopped, ids
        if not stops:
            assert "".join(got) == tok.decode(ids)


def test_the_window_stays_short():
    """Decoding cost per token does not grow with the stream: each call decodes a few tokens,
    about once per token."""
    tok = byte_level()
    lengths = []

    class Counting:
        def decode(self, ids):
            lengths.append(len(ids))
            return tok.decode(ids)

    ids = tok.encode(" ".join(CORPUS[:6])).ids
    stream(TextStream, Counting(), ids, ())
    assert len(ids) > 60 and max(lengths) <= 16
    # about one decode per token: the window's start moves every few tokens, and the decode of
    # its first part is the previous token's window
    assert len(lengths) <= 1.3 * len(ids), (len(lengths), len(ids))


def test_invalid_bytes_stream_as_they_come():
    """A run of tokens that decode to U+FFFD (a lone continuation byte repeated: what an untrained
    model or a stuck one emits) is streamed a few tokens behind, not held back to the end, and
    the window stays short."""
    tok = byte_level()
    bad = next(i for i in range(tok.get_vocab_size()) if tok.decode([i]) == "\ufffd")  # e.g. byte 0xA3
    lengths = []

    class Counting:
        def decode(self, ids):
            lengths.append(len(ids))
            return tok.decode(ids)

    out, _ = stream(TextStream, Counting(), [bad] * 200, ())
    assert "".join(out) == tok.decode([bad] * 200)
    assert all(out[i] for i in range(10, 199)), out[:20]  # every token past the first few sends text
    assert max(lengths) <= 16



def test_the_engine_thread_gets_the_interpreter_back_soon(monkeypatch):
    """The server's process shortens the GIL's switch interval (a decode step is shorter than
    CPython's 5 ms default), and never lengthens one already shorter."""
    import sys

    from archlab.infer.engine_loop import ENGINE_SWITCH_INTERVAL_S, favour_the_engine_thread

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        favour_the_engine_thread()
        assert sys.getswitchinterval() == pytest.approx(ENGINE_SWITCH_INTERVAL_S)
        sys.setswitchinterval(0.0001)
        favour_the_engine_thread()
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    finally:
        sys.setswitchinterval(before)


def test_a_long_stream_keeps_no_growing_text():
    """What a stream keeps between tokens is bounded (the held tail, the window), not the whole
    text so far: a token late in a long stream costs what an early one did."""
    tok = byte_level()
    ids = tok.encode(" ".join(CORPUS)).ids
    s = TextStream(tok, ("THE ENDX",), None)
    for t in ids:
        s.add(t)
    assert len(s.held) < len("THE ENDX") and len(s.before) < 200
    assert not hasattr(s, "decoded") and s.decoded_chars == len(tok.decode(ids[:s.read]))
