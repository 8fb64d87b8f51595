"""User mistakes raise DataError with a message naming the path and the problem, and change no file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from archlab.data import TokenData, prepare
from archlab.errors import DataError
from tests.data.data_testutil import snapshot

Docs = list[tuple[str, str]]


def _open_fails(data_dir: Path, pattern: str) -> None:
    """TokenData(data_dir) raises DataError matching ``pattern`` and leaves the files alone."""
    before = snapshot(data_dir) if data_dir.is_dir() else None
    with pytest.raises(DataError, match=pattern):
        TokenData(data_dir)
    assert (snapshot(data_dir) if data_dir.is_dir() else None) == before


def test_missing_data_dir(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    _open_fails(missing,
                rf"data directory {missing} does not exist; run `archlab data prepare --out {missing}`")
    assert not missing.exists()


def test_directory_without_manifest(real_docs: Docs, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text(real_docs[0][1])
    _open_fails(tmp_path, rf"{tmp_path} has no manifest.json, so it is not a prepared data directory")


def test_corrupt_manifest(data_copy: Path) -> None:
    text = (data_copy / "manifest.json").read_text()
    (data_copy / "manifest.json").write_text(text[: len(text) // 2])
    _open_fails(data_copy, rf"{data_copy}/manifest.json is corrupt \(not valid JSON")


def test_manifest_missing_a_split(data_copy: Path) -> None:
    manifest = json.loads((data_copy / "manifest.json").read_text())
    del manifest["splits"]["val"]
    (data_copy / "manifest.json").write_text(json.dumps(manifest))
    _open_fails(data_copy, r"manifest.json is incomplete or malformed \(no val split\)")


def test_missing_shard(data_copy: Path) -> None:
    (data_copy / "train_002.bin").unlink()
    _open_fails(data_copy, rf"shard {data_copy}/train_002.bin listed in manifest.json is missing")


def test_truncated_shard(data_copy: Path) -> None:
    shard = data_copy / "train_001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    _open_fails(data_copy, rf"shard {shard} has 49998 bytes but manifest.json records 25000 uint16 "
                           r"tokens \(50000 bytes\); it is truncated or was modified")


def test_tokenizer_changed_after_prepare(data_copy: Path) -> None:
    path = data_copy / "tokenizer.json"
    # the same tokenizer, re-serialized compactly: still loadable, but not the recorded file
    path.write_text(json.dumps(json.loads(path.read_text())))
    _open_fails(data_copy, rf"tokenizer {path} has sha256 \w+\.\.\. but manifest.json records \w+\.\.\.")


def test_bad_jsonl_field(real_docs: Docs, tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"body": t}) + "\n" for _, t in real_docs))
    before = snapshot(tmp_path)
    with pytest.raises(DataError, match=rf"{src}:1 has no field 'text' \(its fields: body\); pass --field"):
        prepare(str(src), tmp_path / "out", vocab_size=300)
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]


def test_invalid_jsonl_line(real_docs: Docs, tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": t}) for _, t in real_docs[:3]] + [real_docs[3][1].splitlines()[0]]
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"{src}:4 is not valid JSON"):
        prepare(str(src), tmp_path / "out", vocab_size=300)
    assert not (tmp_path / "out").exists()


def test_prepare_refuses_existing_data_without_overwrite(stdlib_dir: Path) -> None:
    before = snapshot(stdlib_dir.parent)
    with pytest.raises(DataError, match=rf"{stdlib_dir} already holds prepared data; pass --overwrite"):
        prepare("stdlib", stdlib_dir, vocab_size=300, max_bytes=50_000)
    assert snapshot(stdlib_dir.parent) == before


def test_prepare_never_replaces_a_foreign_directory(real_docs: Docs, tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text(real_docs[0][1])
    before = snapshot(tmp_path)
    with pytest.raises(DataError, match=rf"{out} exists, is not empty and holds no manifest.json"):
        prepare("stdlib", out, vocab_size=300, max_bytes=50_000, overwrite=True)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("spec, kwargs, pattern", [
    ("{tmp}/absent", {}, r"data source '.*/absent' does not exist"),
    ("{tmp}/*.parquet", {}, r"no files match the pattern '.*/\*.parquet'"),
    ("{tmp}", {}, r"directory .* holds no text \(.*\.md.*\) files"),
    ("{tmp}", {"fmt": "hf"}, r"is not a Hugging Face save_to_disk folder: it has no state.json"),
    ("stdlib", {"fmt": "jsonl"}, r"the stdlib source is Python files; it takes no --format"),
    ("stdlib", {"fmt": "csv"}, r"unknown data format 'csv'; allowed: auto, text, jsonl, parquet, hf"),
    ("stdlib", {"val_frac": 1.0}, r"val_frac \(--val-frac\) must be between 0 and 1"),
    ("stdlib", {"vocab_size": 100}, r"vocab size must be at least 257"),
])
def test_bad_sources_and_arguments(spec: str, kwargs: dict, pattern: str, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.bin").write_bytes(b"")  # not a text file
    with pytest.raises(DataError, match=pattern):
        prepare(spec.format(tmp=empty), tmp_path / "out", **{"max_bytes": 50_000, **kwargs})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_one_document_is_not_enough(real_docs: Docs, tmp_path: Path) -> None:
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"text": real_docs[0][1]}) + "\n")
    with pytest.raises(DataError, match=r"has 1 non-empty document chunk\(s\) of up to 4096 bytes; at least 2 are needed"):
        prepare(str(src), tmp_path / "out", vocab_size=300)
