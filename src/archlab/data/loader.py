"""``TokenData``: a prepared data directory, checked on open, read through memory maps.

Opening checks everything that would otherwise fail later or, worse, silently train on the wrong
tokens: the manifest, every shard's size, the tokenizer's sha256 against the manifest, and every
shard's sha256 and largest token id (see :mod:`archlab.data.integrity`: hashed once per file
state, so that a second launch on unchanged data starts without reading the shards).

Training batches are stateless: the windows of a batch depend only on ``(seed, step, micro)``.
Two runs with the same data seed see the same tokens, and a run resumed at step ``s`` sees
exactly what it would have seen had it never stopped, with no loader state to checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from archlab.data.integrity import ShardRecord, Verification, verify_shards
from archlab.data.prepare import MANIFEST_FILE, MANIFEST_FORMAT, MANIFEST_VERSION, SPLITS
from archlab.data.tokenizer import file_sha256, load_tokenizer, token_byte_lengths
from archlab.errors import DataError

Batch = tuple[torch.Tensor, torch.Tensor]


class TokenData:
    """The token shards, tokenizer and manifest of a directory written by ``prepare``."""

    def __init__(self, path: str | Path, recheck: bool = False) -> None:
        """Open and check the data directory ``path``.

        ``recheck``: hash every shard even if the verification cache says it is unchanged
        (``archlab data info`` does; training trusts the cache).
        """
        self.path = Path(path)
        self._manifest = self._read_manifest()
        self._dtype = self._manifest_dtype()
        self._shards = {split: self._open_split(split) for split in SPLITS}
        self._tokenizer = self._load_checked_tokenizer()
        # Last, after the cheap checks: a directory that fails them is reported without reading
        # every shard, and the verification cache is written only for data that passed them.
        self.verification: Verification = verify_shards(
            self.path,
            [ShardRecord(shard["file"], shard["sha256"])
             for split in SPLITS for shard in self._split_entry(split)["shards"]],
            self._dtype, self.vocab_size, use_cache=not recheck,
            prepare_hint=f"re-run `archlab data prepare --out {self.path} --overwrite`")
        self._val_cache: dict[tuple[int, int, int], np.ndarray] = {}
        self._token_bytes: np.ndarray | None = None

    # ---- properties ------------------------------------------------------------------------
    @property
    def manifest(self) -> dict[str, Any]:
        return self._manifest

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size: token ids are all below it."""
        return int(self._manifest["vocab_size"])

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def tokenizer_path(self) -> Path:
        return self.path / str(self._manifest["tokenizer"]["file"])

    def n_tokens(self, split: str) -> int:
        """Tokens in ``split``, end-of-text separators included."""
        return int(self._split_entry(split)["n_tokens"])

    def bytes_per_token(self, split: str) -> float:
        """UTF-8 bytes of document text per token of the whole ``split`` (end-of-text separators
        included): a description of the data. Bits per byte over a part of a split divides by the
        bytes of the tokens scored (:meth:`target_bytes`), not by this average.
        """
        entry = self._split_entry(split)
        return int(entry["n_bytes"]) / int(entry["n_tokens"])

    # ---- checks ----------------------------------------------------------------------------
    def check_model_vocab(self, model_vocab_size: int) -> None:
        """Refuse a model whose embedding table cannot hold every token id of this data."""
        if self.vocab_size > model_vocab_size:
            raise DataError(
                f"the data in {self.path} uses {self.vocab_size} token ids but the model has "
                f"model.vocab_size={model_vocab_size}; set model.vocab_size to at least "
                f"{self.vocab_size} (e.g. --set model.vocab_size={self.vocab_size})")

    # ---- batches ---------------------------------------------------------------------------
    def train_batch(self, step: int, micro: int, batch_size: int, seq_len: int, seed: int) -> Batch:
        """``batch_size`` random windows of ``seq_len + 1`` train tokens as int64 ``(x, y)``.

        The windows depend only on ``(seed, step, micro)``. Each window lies inside one shard;
        shards are picked in proportion to how many windows they hold, so every token position
        is (nearly) equally likely wherever it is stored.
        """
        for key, value in (("seed", seed), ("step", step), ("micro", micro)):
            if value < 0:
                raise DataError(f"the data {key} must be >= 0, got {value}")
        shards = self._shards["train"]
        starts = np.array([max(0, len(s) - seq_len) for s in shards], dtype=np.int64)
        self._require_tokens("train", seq_len, bool(starts.sum()))
        rng = np.random.default_rng([seed, step, micro])
        which = rng.choice(len(shards), size=batch_size, p=starts / starts.sum())
        offsets = rng.integers(0, starts[which])
        windows = np.stack([shards[i][o:o + seq_len + 1] for i, o in zip(which, offsets, strict=True)])
        return _to_xy(windows)

    def val_batches(self, n_batches: int, batch_size: int, seq_len: int) -> list[Batch]:
        """The validation batches: the same list every call.

        Windows are taken in order from the start of the val split with stride ``seq_len``, so
        each target token is predicted once. Windows that would run past the end of the split
        are left out, never wrapped to its start (a wrapped stream scores the same tokens twice
        and counts them as more evidence than there is): the list may hold fewer than
        ``n_batches`` batches and its last batch fewer than ``batch_size`` rows. Callers count
        the tokens they score from the targets (``y.numel()``), and see the shortfall with
        :meth:`val_windows`.
        """
        key = (n_batches, batch_size, seq_len)
        if key not in self._val_cache:
            n_windows = self.val_windows(n_batches, batch_size, seq_len)
            needed = n_windows * seq_len + 1
            stream = np.concatenate([np.asarray(s[: needed]) for s in self._shards["val"]])[:needed]
            index = np.arange(n_windows)[:, None] * seq_len + np.arange(seq_len + 1)
            self._val_cache[key] = stream[index]
        windows = self._val_cache[key]
        return [_to_xy(windows[i:i + batch_size]) for i in range(0, len(windows), batch_size)]

    def val_windows(self, n_batches: int, batch_size: int, seq_len: int) -> int:
        """How many of the ``n_batches * batch_size`` requested validation windows of ``seq_len``
        targets fit in the val split (at least one, or a ``DataError``)."""
        for name, value in (("batches", n_batches), ("batch size", batch_size), ("seq_len", seq_len)):
            if value < 1:
                raise DataError(f"the validation {name} must be >= 1, got {value}")
        total = self.n_tokens("val")
        self._require_tokens("val", seq_len, total > seq_len)
        return min(n_batches * batch_size, (total - 1) // seq_len)

    @property
    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text per token id (0 for ``<|endoftext|>``), checked once against the
        val split: its tokens' bytes must add up to the bytes the manifest recorded for it."""
        if self._token_bytes is None:
            table = token_byte_lengths(self._tokenizer)
            counted = sum(int(table[shard[i:i + (1 << 24)]].sum())
                          for shard in self._shards["val"] for i in range(0, len(shard), 1 << 24))
            recorded = int(self._split_entry("val")["n_bytes"])
            if counted != recorded:
                raise DataError(f"the val tokens of {self.path} stand for {counted:,} bytes of text but "
                                f"{MANIFEST_FILE} records {recorded:,}; the tokenizer does not map "
                                "tokens to bytes one to one, so bits per byte cannot be computed")
            self._token_bytes = table
        return self._token_bytes

    def target_bytes(self, targets: torch.Tensor | np.ndarray) -> int:
        """UTF-8 bytes of text that the target token ids stand for: the denominator of bits per
        byte over exactly those targets (``<|endoftext|>`` counts 0 bytes, as in ``n_bytes``)."""
        ids = targets.cpu().numpy() if isinstance(targets, torch.Tensor) else np.asarray(targets)
        return int(self.token_bytes[ids].sum())

    def _require_tokens(self, split: str, seq_len: int, ok: bool) -> None:
        if not ok:
            raise DataError(f"the {split} split of {self.path} has {self.n_tokens(split)} tokens "
                            f"(largest shard {max(len(s) for s in self._shards[split])}); windows of "
                            f"train.seq_len+1={seq_len + 1} tokens need more: lower train.seq_len "
                            "or prepare more data")

    # ---- opening ---------------------------------------------------------------------------
    def _read_manifest(self) -> dict[str, Any]:
        prepare_hint = f"run `archlab data prepare --out {self.path}`"
        if not self.path.exists():
            raise DataError(f"data directory {self.path} does not exist; {prepare_hint}")
        if not self.path.is_dir():
            raise DataError(f"data path {self.path} is not a directory")
        manifest_path = self.path / MANIFEST_FILE
        if not manifest_path.is_file():
            raise DataError(f"{self.path} has no {MANIFEST_FILE}, so it is not a prepared data "
                            f"directory; {prepare_hint}")
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{manifest_path} is corrupt (not valid JSON: {e}); "
                            f"{prepare_hint} --overwrite") from None
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            raise DataError(f"{manifest_path} is not an archlab data manifest")
        if manifest.get("version") != MANIFEST_VERSION:
            raise DataError(f"{manifest_path} has format version {manifest.get('version')!r}; this "
                            f"archlab reads version {MANIFEST_VERSION}; {prepare_hint} --overwrite")
        problem = _manifest_problem(manifest)
        if problem:
            raise DataError(f"{manifest_path} is incomplete or malformed ({problem}); "
                            f"{prepare_hint} --overwrite")
        return manifest

    def _manifest_dtype(self) -> np.dtype:
        name = self._manifest["dtype"]
        if not isinstance(name, str) or name not in ("uint16", "uint32"):
            raise DataError(f"{self.path / MANIFEST_FILE}: unsupported token dtype {name!r}")
        return np.dtype(name)

    def _open_split(self, split: str) -> list[np.memmap]:
        """Memory-map each shard read-only after checking its size against the manifest."""
        entry = self._split_entry(split)
        shards = []
        for shard in entry["shards"]:
            path = self.path / shard["file"]
            if not path.is_file():
                raise DataError(f"shard {path} listed in {MANIFEST_FILE} is missing; the data "
                                f"directory is incomplete, re-run `archlab data prepare --out "
                                f"{self.path} --overwrite`")
            expected = int(shard["n_tokens"]) * self._dtype.itemsize
            actual = path.stat().st_size
            if actual != expected:
                raise DataError(f"shard {path} has {actual} bytes but {MANIFEST_FILE} records "
                                f"{shard['n_tokens']} {self._dtype.name} tokens ({expected} bytes); "
                                "it is truncated or was modified")
            shards.append(np.memmap(path, dtype=self._dtype, mode="r"))
        if sum(len(s) for s in shards) != entry["n_tokens"]:
            raise DataError(f"{self.path / MANIFEST_FILE}: the {split} shards do not add up to "
                            f"the recorded {entry['n_tokens']} tokens")
        return shards

    def _load_checked_tokenizer(self) -> Tokenizer:
        path = self.tokenizer_path
        if not path.is_file():
            raise DataError(f"tokenizer file {path} is missing from the data directory")
        expected = self._manifest["tokenizer"]["sha256"]
        actual = file_sha256(path)
        if actual != expected:
            raise DataError(f"tokenizer {path} has sha256 {actual[:12]}... but {MANIFEST_FILE} "
                            f"records {expected[:12]}...: it changed after the tokens were made; "
                            "restore it or re-run `archlab data prepare --overwrite`")
        tokenizer = load_tokenizer(path)
        if tokenizer.get_vocab_size() != self.vocab_size:
            raise DataError(f"tokenizer {path} has {tokenizer.get_vocab_size()} tokens but "
                            f"{MANIFEST_FILE} records vocab_size={self.vocab_size}")
        return tokenizer

    def _split_entry(self, split: str) -> dict[str, Any]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        entry: dict[str, Any] = self._manifest["splits"][split]
        return entry


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What is missing or mistyped in a manifest, or None: checked once so that later code can
    index it freely."""
    tokenizer = manifest.get("tokenizer")
    if not (isinstance(tokenizer, dict) and isinstance(tokenizer.get("file"), str)
            and isinstance(tokenizer.get("sha256"), str)):
        return "no tokenizer file and sha256"
    if not isinstance(manifest.get("vocab_size"), int):
        return "vocab_size is missing or not an integer"
    splits = manifest.get("splits")
    for split in SPLITS:
        entry = splits.get(split) if isinstance(splits, dict) else None
        if not isinstance(entry, dict):
            return f"no {split} split"
        for key in ("n_tokens", "n_bytes", "n_docs"):
            if not isinstance(entry.get(key), int) or entry[key] <= 0:
                return f"splits.{split}.{key} is missing or not a positive integer"
        shards = entry.get("shards")
        if not isinstance(shards, list) or not shards:
            return f"splits.{split} lists no shards"
        for shard in shards:
            if not (isinstance(shard, dict) and isinstance(shard.get("file"), str)
                    and Path(shard["file"]).name == shard["file"]
                    and isinstance(shard.get("n_tokens"), int) and isinstance(shard.get("sha256"), str)):
                return f"splits.{split} has a malformed shard entry {shard!r}"
    return None


def _to_xy(windows: np.ndarray) -> Batch:
    """Windows of ``seq_len + 1`` tokens -> inputs and next-token targets, int64."""
    tokens = torch.from_numpy(windows.astype(np.int64))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
