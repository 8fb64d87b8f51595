"""Helpers for the data tests that read prepared directories directly, not through TokenData."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

STDLIB = Path(sysconfig.get_path("stdlib")).resolve()
# The session's stdlib corpus: 300 KB keeps the folder fast; small shards give several train shards.
STDLIB_ARGS: dict[str, Any] = {"max_bytes": 300_000, "vocab_size": 512, "val_frac": 0.1,
                               "shard_tokens": 25_000}


def read_documents(data_dir: Path) -> list[dict[str, Any]]:
    lines = (data_dir / "documents.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def split_tokens(data_dir: Path, split: str) -> np.ndarray:
    """All tokens of a split, read straight from the shard files (not through TokenData)."""
    manifest = json.loads((data_dir / "manifest.json").read_text())
    dtype = np.dtype(manifest["dtype"])
    return np.concatenate([np.fromfile(data_dir / s["file"], dtype=dtype)
                           for s in manifest["splits"][split]["shards"]])


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root`` (hidden ones included) with its bytes and mtime."""
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def doc_folder(folder: Path, docs: list[tuple[str, str]]) -> Path:
    """A folder source holding ``docs`` as one ``.txt`` file each."""
    folder.mkdir()
    for name, doc in docs:
        (folder / f"{name}.txt").write_text(doc)
    return folder
