"""Shard integrity: shards changed after prepare are refused on open and by `archlab data info`,
token ids outside the vocabulary are a DataError (not an IndexError at step 1), and an unchanged
directory is hashed once, not on every open."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from archlab.data import TokenData, integrity
from archlab.data.integrity import VERIFY_FILE
from archlab.errors import DataError
from tests.data.recipes_testutil import run_cli

N_SHARDS = 6  # the session's stdlib directory: 5 train shards and 1 val shard


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the shards read by digest_shard, in call order."""
    calls: list[str] = []
    real = integrity.digest_shard

    def counting(path: Path, dtype: np.dtype) -> integrity.ShardDigest:
        calls.append(path.name)
        return real(path, dtype)

    monkeypatch.setattr(integrity, "digest_shard", counting)
    return calls


def _refused(data_dir: Path, pattern: str) -> None:
    """Opening ``data_dir`` and `archlab data info` both fail with ``pattern``, in one line."""
    with pytest.raises(DataError, match=pattern) as opened:
        TokenData(data_dir)
    assert "\n" not in str(opened.value)
    with pytest.raises(DataError, match=pattern):
        run_cli(["data", "info", str(data_dir)])


def test_shard_rewritten_with_other_valid_ids_is_refused(data_copy: Path) -> None:
    TokenData(data_copy)  # verified and remembered: the cache must not hide what follows
    shard, other = data_copy / "train_001.bin", data_copy / "train_000.bin"
    before = shard.stat()
    assert before.st_size == other.stat().st_size
    shard.write_bytes(other.read_bytes())  # same size, every id valid, other tokens
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))  # even with the old mtime
    assert shard.stat().st_mtime_ns == before.st_mtime_ns
    _refused(data_copy, rf"^shard {shard} does not match manifest.json: its sha256 is \w{{12}}\.\.\. "
                        rf"but \w{{12}}\.\.\. was recorded, so it changed after prepare; re-run "
                        rf"`archlab data prepare --out {data_copy} --overwrite`$")


def test_shard_of_ff_bytes_is_a_data_error_not_an_index_error(data_copy: Path) -> None:
    shard = data_copy / "val_000.bin"
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    _refused(data_copy, rf"^shard {shard} does not match manifest.json: .* changed after prepare "
                        r"\(it holds token id 65535, outside the vocabulary of 512\); re-run "
                        r"`archlab data prepare")
    # a manifest that records those very bytes: the hash passes, the id check still refuses
    manifest = json.loads((data_copy / "manifest.json").read_text())
    found = integrity.digest_shard(shard, np.dtype("uint16"))
    manifest["splits"]["val"]["shards"][0]["sha256"] = found.sha256
    (data_copy / "manifest.json").write_text(json.dumps(manifest))
    _refused(data_copy, rf"^shard {shard}: it holds token id 65535, outside the vocabulary of 512 "
                        r"\(ids 0\.\.511\), although its sha256 matches manifest.json")


def test_an_unchanged_directory_is_hashed_once(data_copy: Path, hashed: list[str]) -> None:
    first = TokenData(data_copy)  # a copy: other inodes, so the copied cache does not count
    assert len(hashed) == N_SHARDS and first.verification.n_hashed == N_SHARDS
    assert (data_copy / VERIFY_FILE).is_file()
    hashed.clear()
    second = TokenData(data_copy)
    assert hashed == [] and second.verification.n_hashed == 0
    assert second.verification.max_id == first.verification.max_id == 511
    assert second.verification.n_bytes == sum(p.stat().st_size for p in data_copy.glob("*.bin"))

    # touching a shard (same bytes) re-verifies that shard only
    os.utime(data_copy / "train_003.bin")
    TokenData(data_copy)
    assert hashed == ["train_003.bin"]
    hashed.clear()
    TokenData(data_copy)
    assert hashed == []

    # archlab data info always hashes everything, whatever the cache says, and says so
    assert run_cli(["data", "info", str(data_copy)]) == 0
    assert len(hashed) == N_SHARDS


def test_info_says_what_it_checked(data_copy: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    assert run_cli(["data", "info", str(data_copy)]) == 0
    out = capsys.readouterr().out
    size = sum(p.stat().st_size for p in data_copy.glob("*.bin"))
    assert (f"checked: manifest.json complete; tokenizer.json sha256 matches; 6 shards ({size:,} "
            "bytes): sizes and sha256 recomputed, all match manifest.json; token ids all below "
            "vocab_size 512 (largest 511)") in out


def test_an_unreadable_cache_is_ignored_and_replaced(data_copy: Path, hashed: list[str]) -> None:
    (data_copy / VERIFY_FILE).write_text('{"format": "archlab-verified", "shards": ')
    TokenData(data_copy)
    assert len(hashed) == N_SHARDS
    assert json.loads((data_copy / VERIFY_FILE).read_text())["vocab_size"] == 512
    hashed.clear()
    TokenData(data_copy)
    assert hashed == []
    assert not list(data_copy.glob(f"{VERIFY_FILE}.tmp-*"))
