"""Shard integrity: every shard's bytes against the manifest's sha256, and its token ids against
the vocabulary, verified once per file state.

A shard's size is checked on every open (a ``stat``), but its size cannot tell a shard that was
overwritten in place: such a shard would train silently on other tokens, or, with ids outside
the vocabulary, crash the first forward pass. So each shard is hashed and its largest token id
read, in one pass over the file, and both are compared with the manifest.

Hashing costs a read of every shard (about a second per GB), which training start should not pay
on every launch. A successful verification is therefore remembered in ``VERIFY_FILE`` inside the
data directory, keyed by each shard's file state: name, size, mtime_ns, ctime_ns and inode.
Writing a file changes its mtime and ctime, and ctime cannot be set back by a user (``touch -d``
restores only the mtime), so a shard that was modified, replaced or copied in is hashed again;
an unchanged one is not. The file is an optimisation only: it is written atomically (a
temporary renamed into place), a directory that cannot be written simply verifies on every
open, and an unreadable or foreign file is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from archlab.errors import DataError

VERIFY_FILE = ".archlab-verified.json"
VERIFY_FORMAT = "archlab-verified"
VERIFY_VERSION = 1
# Read shards in chunks of this many bytes: a multiple of every token size (2 and 4 bytes).
_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class ShardDigest:
    """What one read of a shard gives: its sha256 and its largest token id (-1 if empty)."""

    sha256: str
    max_id: int


@dataclass(frozen=True)
class ShardRecord:
    """A shard as the manifest lists it: file name (in the data directory) and recorded sha256."""

    file: str
    sha256: str


@dataclass(frozen=True)
class Verification:
    """What a verification checked: shards, bytes, how many were hashed this time (the others
    matched the verification cache), and the largest token id found."""

    n_shards: int
    n_bytes: int
    n_hashed: int
    max_id: int
    vocab_size: int


def digest_shard(path: Path, dtype: np.dtype) -> ShardDigest:
    """The sha256 and the largest token id of the shard at ``path``, in one read."""
    digest = hashlib.sha256()
    max_id = -1
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
            whole = len(chunk) - len(chunk) % dtype.itemsize  # a torn last token is no id
            if whole:
                max_id = max(max_id, int(np.frombuffer(chunk[:whole], dtype=dtype).max()))
    return ShardDigest(digest.hexdigest(), max_id)


def verify_shards(directory: Path, shards: list[ShardRecord], dtype: np.dtype, vocab_size: int,
                  use_cache: bool = True,
                  prepare_hint: str = "re-run `archlab data prepare`") -> Verification:
    """Check every shard's sha256 against the manifest and its token ids against ``vocab_size``.

    With ``use_cache``, shards whose file state matches ``VERIFY_FILE`` are not read again;
    without it, every shard is hashed (``archlab data info``). Either way a successful check is
    recorded. The first bad shard raises a one-line ``DataError`` naming it; nothing is written
    then.
    """
    known = _read_cache(directory, dtype, vocab_size) if use_cache else {}
    fresh: dict[str, dict[str, Any]] = {}
    n_bytes = n_hashed = 0
    max_id = -1
    for shard in shards:
        path = directory / shard.file
        stamp = _stamp(path)
        n_bytes += stamp["size"]
        entry = known.get(shard.file)
        if (entry is not None and entry.get("stamp") == stamp and entry.get("sha256") == shard.sha256
                and entry["max_id"] < vocab_size):
            fresh[shard.file] = entry
            max_id = max(max_id, int(entry["max_id"]))
            continue
        found = digest_shard(path, dtype)
        n_hashed += 1
        _check(path, shard, found, vocab_size, prepare_hint)
        # Stamped before the read: a write during the read changes the file state, so the entry
        # can only ever be stale towards hashing again, never towards trusting changed bytes.
        fresh[shard.file] = {"stamp": stamp, "sha256": found.sha256, "max_id": found.max_id}
        max_id = max(max_id, found.max_id)
    if n_hashed or len(fresh) != len(known):
        _write_cache(directory, dtype, vocab_size, fresh)
    return Verification(len(shards), n_bytes, n_hashed, max_id, vocab_size)


def _check(path: Path, shard: ShardRecord, found: ShardDigest, vocab_size: int, hint: str) -> None:
    outside = found.max_id >= vocab_size
    ids = (f"it holds token id {found.max_id}, outside the vocabulary of {vocab_size}"
           if outside else "")
    if found.sha256 != shard.sha256:
        raise DataError(f"shard {path} does not match manifest.json: its sha256 is "
                        f"{found.sha256[:12]}... but {shard.sha256[:12]}... was recorded, so it "
                        f"changed after prepare{f' ({ids})' if ids else ''}; {hint}")
    if outside:
        raise DataError(f"shard {path}: {ids} (ids 0..{vocab_size - 1}), although its sha256 "
                        f"matches manifest.json: the manifest does not describe these tokens; {hint}")


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino}


def _read_cache(directory: Path, dtype: np.dtype, vocab_size: int) -> dict[str, dict[str, Any]]:
    """The cache's shard entries, or none when it is missing, unreadable or for other tokens."""
    try:
        data = json.loads((directory / VERIFY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not (isinstance(data, dict) and data.get("format") == VERIFY_FORMAT
            and data.get("version") == VERIFY_VERSION and data.get("dtype") == dtype.name
            and data.get("vocab_size") == vocab_size and isinstance(data.get("shards"), dict)):
        return {}
    return {name: entry for name, entry in data["shards"].items()
            if isinstance(entry, dict) and isinstance(entry.get("max_id"), int)}


def _write_cache(directory: Path, dtype: np.dtype, vocab_size: int,
                 shards: dict[str, dict[str, Any]]) -> None:
    """Replace the cache atomically; any failure (read-only directory, full disk) is ignored:
    the next open verifies again."""
    data = {"format": VERIFY_FORMAT, "version": VERIFY_VERSION, "dtype": dtype.name,
            "vocab_size": vocab_size, "shards": shards}
    tmp = directory / f"{VERIFY_FILE}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, directory / VERIFY_FILE)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
