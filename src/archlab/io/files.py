"""File digests: the sha256 that identifies a tokenizer, a shard or a checkpoint file.

Here, in ``io``, so that checkpoints (``archlab.io.checkpoint``) hash files without importing the
data package, which sits above ``io`` (it reads checkpoints for their tokenizers). Free of torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in chunks so large shards do not need to fit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


__all__ = ["file_sha256"]
