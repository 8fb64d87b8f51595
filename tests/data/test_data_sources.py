"""Document sources on small real fixtures: stdlib, folder, glob, JSONL(.gz), Parquet, HF layout."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from archlab.data import TokenData, prepare
from archlab.data.sources import open_source
from archlab.errors import DataError
from tests.data.data_testutil import STDLIB, read_documents, split_tokens

Docs = list[tuple[str, str]]


def _names_and_texts(spec: str, **kwargs: Any) -> Docs:
    return list(open_source(spec, **kwargs).documents())


def test_stdlib_is_sorted_library_code_within_budget() -> None:
    docs = _names_and_texts("stdlib", max_bytes=2_000_000)
    names = [n for n, _ in docs]
    assert names == sorted(names) and names[0] == "__future__.py"
    assert "asyncio/base_events.py" in names and "argparse.py" in names
    assert not any(part in ("test", "tests", "idle_test", "site-packages")
                   for n in names for part in n.split("/"))
    assert sum(len(t.encode()) for _, t in docs) == 2_000_000
    *whole, (last_name, last_text) = docs
    for name, text in whole[:20]:
        assert text == (STDLIB / name).read_text(encoding="utf-8")
    assert (STDLIB / last_name).read_text(encoding="utf-8").startswith(last_text)
    # the default is the 8 MB budget; 0 means the whole library (larger)
    assert open_source("stdlib").max_bytes == 8_000_000
    assert open_source("stdlib", max_bytes=0).max_bytes is None


def _write_folder(root: Path, docs: Docs) -> dict[str, str]:
    """Real docstrings as .txt/.md files in nested folders, plus files that must be skipped.

    Returns the text documents written, by path relative to ``root``.
    """
    written = {}
    for i, (name, text) in enumerate(docs):
        folder = ("guides" if i % 2 else "notes") + ("/deep" if i % 3 == 0 else "")
        rel = f"{folder}/{name}.{'md' if i % 2 else 'txt'}"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
        written[rel] = text
    (root / ".hidden").mkdir()
    (root / ".hidden" / "notes.txt").write_text(docs[0][1])  # hidden: skipped
    (root / "records.jsonl").write_text(json.dumps({"text": docs[0][1]}) + "\n")  # not text
    (root / "module.pyc").write_bytes((STDLIB / "__future__.py").read_bytes())  # not text
    return written


def test_folder_reads_text_files_recursively_in_path_order(real_docs: Docs, tmp_path: Path) -> None:
    written = _write_folder(tmp_path / "corpus", real_docs)
    docs = _names_and_texts(str(tmp_path / "corpus"))
    assert docs == sorted(written.items())
    source = open_source(str(tmp_path / "corpus"))
    assert (source.fmt, source.path) == ("text", str((tmp_path / "corpus").resolve()))


def test_glob_selects_matching_files_named_below_the_pattern_root(real_docs: Docs, tmp_path: Path) -> None:
    written = _write_folder(tmp_path / "corpus", real_docs)
    docs = _names_and_texts(str(tmp_path / "corpus" / "**" / "*.md"))
    expected = sorted((rel, text) for rel, text in written.items() if rel.endswith(".md"))
    assert docs == expected and any(rel.startswith("guides/deep/") for rel, _ in expected)
    with pytest.raises(DataError, match=r"matches files of several formats \(jsonl, text\)"):
        open_source(str(tmp_path / "corpus" / "*.*"))


def test_jsonl_and_gzip_jsonl(real_docs: Docs, tmp_path: Path) -> None:
    lines = [json.dumps({"title": n, "body": t}) for n, t in real_docs]
    lines.insert(3, "")  # blank lines are skipped but still counted for line numbers
    plain = tmp_path / "docs.jsonl"
    plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
    packed = tmp_path / "docs.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    for path in (plain, packed):
        docs = _names_and_texts(str(path), field="body")
        assert [t for _, t in docs] == [t for _, t in real_docs]
        assert docs[2][0] == f"{path.name}:3" and docs[3][0] == f"{path.name}:5"
        titles = _names_and_texts(str(path), field="title")
        assert [t for _, t in titles] == [n for n, _ in real_docs]
    # a directory read as JSONL takes both files, in name order
    both = _names_and_texts(str(tmp_path), fmt="jsonl", field="body")
    assert [n for n, _ in both][:: len(real_docs)] == ["docs.jsonl:1", "docs.jsonl.gz:1"]
    assert len(both) == 2 * len(real_docs)


def test_parquet(real_docs: Docs, tmp_path: Path) -> None:
    path = tmp_path / "docs.parquet"
    table = pa.table({"id": list(range(len(real_docs))), "text": [t for _, t in real_docs]})
    pq.write_table(table, path, row_group_size=5)  # several row groups
    docs = _names_and_texts(str(path))
    assert docs == [(f"docs.parquet:{i}", t) for i, (_, t) in enumerate(real_docs)]
    with pytest.raises(DataError, match=r"docs.parquet has no column 'body' \(its columns: id, text\)"):
        _names_and_texts(str(path), field="body")
    with pytest.raises(DataError, match=r"column 'id' holds int64, not text"):
        _names_and_texts(str(path), field="id")


def _save_to_disk_layout(folder: Path, texts: list[str]) -> None:
    """What ``datasets.Dataset.save_to_disk`` writes: Arrow IPC streams plus state.json and
    dataset_info.json."""
    folder.mkdir(parents=True)
    half = len(texts) // 2
    files = []
    for i, chunk in enumerate((texts[:half], texts[half:])):
        name = f"data-{i:05d}-of-00002.arrow"
        table = pa.table({"text": chunk, "n_chars": [len(t) for t in chunk]})
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=3):
                writer.write_batch(batch)
        files.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({
        "_data_files": files, "_fingerprint": "0a1b2c3d4e5f6789", "_format_columns": None,
        "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": "train"}))
    (folder / "dataset_info.json").write_text(json.dumps({
        "features": {"text": {"dtype": "string", "_type": "Value"},
                     "n_chars": {"dtype": "int64", "_type": "Value"}}}))


def test_hf_save_to_disk_dataset_and_dataset_dict(real_docs: Docs, tmp_path: Path) -> None:
    texts = [t for _, t in real_docs]
    _save_to_disk_layout(tmp_path / "ds", texts)
    docs = _names_and_texts(str(tmp_path / "ds"))
    assert [t for _, t in docs] == texts
    assert docs[0][0] == "data-00000-of-00002.arrow:0"
    assert docs[-1][0] == f"data-00001-of-00002.arrow:{len(texts) - len(texts) // 2 - 1}"
    assert open_source(str(tmp_path / "ds")).fmt == "hf"
    arrow_file = tmp_path / "ds" / "data-00001-of-00002.arrow"  # one stream file, given directly
    assert [t for _, t in _names_and_texts(str(arrow_file))] == texts[len(texts) // 2:]

    dd = tmp_path / "dd"
    _save_to_disk_layout(dd / "train", texts[:10])
    _save_to_disk_layout(dd / "validation", texts[10:])
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    assert [t for _, t in _names_and_texts(str(dd))] == texts[:10]
    assert [t for _, t in _names_and_texts(str(dd), split="validation")] == texts[10:]
    with pytest.raises(DataError, match=r"without the split 'test'; its splits: train, validation"):
        open_source(str(dd), split="test")


@pytest.mark.parametrize("kind", ["folder", "jsonl", "parquet", "hf"])
def test_prepare_from_each_format_round_trips(kind: str, real_docs: Docs, tmp_path: Path) -> None:
    texts = [t for _, t in real_docs]
    if kind == "folder":
        _write_folder(tmp_path / "src", real_docs)
        spec = str(tmp_path / "src")
    elif kind == "jsonl":
        spec = str(tmp_path / "src.jsonl")
        Path(spec).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    elif kind == "parquet":
        spec = str(tmp_path / "src.parquet")
        pq.write_table(pa.table({"text": texts}), spec)
    else:
        spec = str(tmp_path / "src")
        _save_to_disk_layout(Path(spec), texts)
    manifest = prepare(spec, tmp_path / "out", vocab_size=300, val_frac=0.2)
    assert manifest["sources"][0]["fmt"] == {"folder": "text"}.get(kind, kind)
    data = TokenData(tmp_path / "out")
    streams = {split: split_tokens(tmp_path / "out", split) for split in ("train", "val")}
    decoded: dict[str, str] = {}  # long documents come in pieces ("name#first-last"), in order
    for doc in read_documents(tmp_path / "out"):
        ids = streams[doc["split"]][doc["offset"]: doc["offset"] + doc["n_tokens"] - 1]
        name = doc["name"].split("#")[0]
        decoded[name] = decoded.get(name, "") + data.tokenizer.decode(ids.tolist())
    assert sorted(decoded.values()) == sorted(texts)
    assert manifest["splits"]["val"]["n_docs"] >= 1 and manifest["splits"]["train"]["n_docs"] >= 1
