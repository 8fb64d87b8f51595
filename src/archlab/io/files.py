"""Files: the sha256 that identifies a tokenizer, a shard or a checkpoint file, and I/O errors
that name the file they are about.

Here, in ``io``, so that checkpoints (``archlab.io.checkpoint``) hash files without importing the
data package, which sits above ``io`` (it reads checkpoints for their tokenizers). Free of torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in chunks so large shards do not need to fit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Give an ``OSError`` raised in the block the file it is about, ``path``, when it names none
    (a failed write or close does not), and turn the I/O errors that safetensors' writer reports as
    ``SafetensorError("... (os error N)")`` into that ``OSError``: the CLI then says in one line
    which file could not be written and why (``archlab.errors.unwritable_path``)."""
    from safetensors import SafetensorError  # torch-free, like this module

    try:
        yield
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise  # not an I/O error (a bad tensor): a bug's traceback
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from e
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


__all__ = ["file_sha256", "naming"]


def cache_home() -> Path:
    """archlab's folder of caches: ``$XDG_CACHE_HOME/archlab``, else ``~/.cache/archlab`` (the
    recipes' downloads and the command line's bytecode live in folders under it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "archlab"
