"""Byte-level BPE tokenizers trained locally with HF ``tokenizers``.

Byte-level means every string is encodable and decodes back exactly (no unknown token), which
matters because bits per byte is computed from token counts and UTF-8 byte counts of the same
text. ``add_prefix_space=False`` keeps decoding an exact inverse of encoding. The single special
token ``<|endoftext|>`` has id 0 and separates documents in the token stream. It is only ever
inserted by id: the literal string in a document (this very file contains it) is encoded as
ordinary text (``encode_special_tokens = True``), so id 0 inside the stream always means a real
document boundary. ``tokenizer.json`` does not store that flag, hence ``load_tokenizer``.

A tokenizer is identified by the sha256 of its ``tokenizer.json`` bytes: the manifest records it
and the loader refuses a tokenizer file that no longer matches the tokens on disk.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from archlab.errors import DataError
from archlab.io.files import file_sha256  # re-exported: the data package's callers import it from here

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0
TOKENIZER_FILE = "tokenizer.json"
# 256 byte symbols plus the end-of-text token: the smallest vocabulary that can encode anything.
MIN_VOCAB_SIZE = 257


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on ``texts``; the same texts in the same order give the same file.

    The vocabulary can end up smaller than ``vocab_size`` when the corpus has too few distinct
    pairs to merge; callers should read the size back with ``get_vocab_size()``.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(f"vocab size must be at least {MIN_VOCAB_SIZE} (256 bytes + {EOS_TOKEN}), "
                        f"got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.token_to_id(EOS_TOKEN) != EOS_ID:
        raise RuntimeError(f"{EOS_TOKEN} did not get id {EOS_ID}")
    tokenizer.encode_special_tokens = True
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> str:
    """Write ``tokenizer.json`` and return its sha256. A failed write is an ``OSError`` naming
    ``path`` (``tokenizers`` raises a plain Exception that only carries the OS error's text),
    so that callers can tell a full disk from a bug."""
    try:
        tokenizer.save(str(path))
    except Exception as e:
        m = re.search(r"\(os error (\d+)\)", str(e))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None
    return file_sha256(path)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a ``tokenizer.json``; a missing or unreadable file is the user's data problem."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"tokenizer file {p} does not exist")
    try:
        tokenizer = Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises plain Exception for any parse failure
        raise DataError(f"tokenizer file {p} is not a valid tokenizers JSON file: {e}") from None
    tokenizer.encode_special_tokens = True  # not stored in tokenizer.json; see module docstring
    return tokenizer


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes of text that each token id stands for, as an int64 array indexed by id.

    Bits per byte divides the loss over some target tokens by the bytes *of those tokens*, so it
    needs every token's own byte count, computed here once per vocabulary.

    Why not ``len(tokenizer.decode([id]).encode())``: decoding one token at a time differs from
    decoding the whole string at the boundaries. A byte-level token that holds part of a
    multi-byte character (``é`` is two byte symbols, often two tokens) decodes on its own to
    U+FFFD, 3 bytes instead of 1; a metaspace decoder drops the leading ``▁`` of the first token
    only; byte-fallback ``<0x..>`` tokens decode to nothing alone. For a byte-level BPE (the only
    kind archlab trains) the vocabulary string of a token is its bytes, one alphabet symbol per
    byte (GPT-2's byte-to-unicode map), so its length in symbols is its exact byte count and
    the per-token counts of an encoded text add up to that text's UTF-8 length: checked on real
    text by the tests and on every validation split by ``TokenData.target_bytes``. Special tokens
    (``<|endoftext|>``) are inserted by id between documents and stand for no text: 0 bytes.
    """
    from tokenizers import decoders

    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        raise DataError(f"bits per byte needs a byte-level BPE tokenizer (what `archlab data prepare` "
                        f"trains); this one decodes with {type(tokenizer.decoder).__name__}")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    lengths = np.zeros(tokenizer.get_vocab_size(), dtype=np.int64)
    for piece, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if piece in special:
            continue
        if not set(piece) <= alphabet:
            raise DataError(f"token {token_id} ({piece!r}) is not made of byte-level symbols; bits per "
                            "byte cannot be counted exactly with this tokenizer")
        lengths[token_id] = len(piece)
    return lengths


def find_tokenizer(path: str | Path) -> Path:
    """The ``tokenizer.json`` that ``path`` names: the file itself, a prepared data directory's
    (checked against its manifest's sha256), or a checkpoint's (a run directory means its latest
    checkpoint; the trainer copies the data's tokenizer into every checkpoint)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if not p.is_dir():
        raise DataError(f"--tokenizer {p} does not exist; give a prepared data directory, a run or "
                        f"checkpoint directory, or a {TOKENIZER_FILE} file")
    manifest_path = p / "manifest.json"
    if manifest_path.is_file():
        import json

        try:
            entry = json.loads(manifest_path.read_text(encoding="utf-8"))["tokenizer"]
            tok, sha = p / entry["file"], entry["sha256"]
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{manifest_path} is not a readable archlab data manifest") from None
        if not tok.is_file() or file_sha256(tok) != sha:
            raise DataError(f"{tok} is missing or no longer the tokenizer {manifest_path} records")
        return tok
    from archlab.errors import CheckpointError
    from archlab.io.checkpoint import resolve_checkpoint  # imports torch: only for checkpoints

    try:
        ckpt = resolve_checkpoint(p)
    except CheckpointError:
        raise DataError(f"--tokenizer {p} is neither prepared data (no manifest.json) nor a run or "
                        "checkpoint directory") from None
    if not (ckpt / TOKENIZER_FILE).is_file():
        raise DataError(f"checkpoint {ckpt} carries no {TOKENIZER_FILE}; pass the data directory it "
                        "was trained on as --tokenizer")
    return ckpt / TOKENIZER_FILE


def load_reusable_tokenizer(path: Path) -> Tokenizer:
    """Load a tokenizer to prepare more data with: it must be one archlab trains (byte-level,
    ``<|endoftext|>`` = 0), since the shards, the loader and bits per byte rely on both."""
    tokenizer = load_tokenizer(path)
    if tokenizer.token_to_id(EOS_TOKEN) != EOS_ID:
        raise DataError(f"tokenizer {path} does not have {EOS_TOKEN} as id {EOS_ID}; archlab separates "
                        "documents with it")
    token_byte_lengths(tokenizer)  # one clear line if it is not byte-level
    return tokenizer
