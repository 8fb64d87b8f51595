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
from archlab.data.tokenizer import file_sha256, load_tokenizer
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
        """UTF-8 bytes of document text per token of ``split``.

        Tokens include the end-of-text separators, as the loss does, so
        ``bits_per_byte = loss_nats / ln(2) / bytes_per_token``.
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
        each target token is predicted once; if the split is shorter than needed it is read
        again from the start (the stream wraps after a document's end-of-text token).
        """
        key = (n_batches, batch_size, seq_len)
        if key not in self._val_cache:
            total = self.n_tokens("val")
            self._require_tokens("val", seq_len, total > seq_len)
            needed = n_batches * batch_size * seq_len + 1
            stream = np.concatenate([np.asarray(s[: needed]) for s in self._shards["val"]])
            stream = np.resize(stream[:needed], needed)  # repeats from the start if short
            index = np.arange(n_batches * batch_size)[:, None] * seq_len + np.arange(seq_len + 1)
            self._val_cache[key] = stream[index].reshape(n_batches, batch_size, seq_len + 1)
        return [_to_xy(windows) for windows in self._val_cache[key]]

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
