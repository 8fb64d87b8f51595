"""prepare(): manifest, shards, tokens that decode to the source text, the split, atomic writes."""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import numpy as np
import pytest

from archlab.data import prepare
from archlab.data.integrity import VERIFY_FILE
from archlab.data.tokenizer import EOS_ID, load_tokenizer
from tests.data.data_testutil import (
    STDLIB,
    STDLIB_ARGS,
    doc_folder,
    read_documents,
    snapshot,
    split_tokens,
)

Docs = list[tuple[str, str]]


def _manifest(data_dir: Path) -> dict:
    return json.loads((data_dir / "manifest.json").read_text())


def test_manifest_describes_the_shards(stdlib_dir: Path) -> None:
    m = _manifest(stdlib_dir)
    assert (m["format"], m["version"], m["dtype"]) == ("archlab-tokens", 1, "uint16")
    assert m["vocab_size"] == m["vocab_size_requested"] == 512
    assert m["sources"] == [{"spec": "stdlib", "fmt": "stdlib", "path": str(STDLIB),
                             "max_bytes": 300_000, "python": platform.python_version(),
                             "excluded_dirs": ["__pycache__", "idle_test", "site-packages", "test",
                                               "tests", "config-*"],
                             "encoding": "utf-8", "replaced_bytes": 0}]
    assert m["split"]["seed"] == 0 and m["split"]["val_frac"] == 0.1
    tokenizer_bytes = (stdlib_dir / "tokenizer.json").read_bytes()
    assert m["tokenizer"]["sha256"] == hashlib.sha256(tokenizer_bytes).hexdigest()
    assert len(m["splits"]["train"]["shards"]) == 5  # ~100k train tokens in 25k-token shards
    for split in ("train", "val"):
        entry = m["splits"][split]
        for shard in entry["shards"]:
            data = (stdlib_dir / shard["file"]).read_bytes()
            assert len(data) == 2 * shard["n_tokens"]
            assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        assert entry["n_tokens"] == sum(s["n_tokens"] for s in entry["shards"])
        assert all(s["n_tokens"] == 25_000 for s in entry["shards"][:-1])
        tokens = split_tokens(stdlib_dir, split)
        assert tokens.max() < 512
        # one end-of-text per document, and the stream ends with one
        assert int((tokens == EOS_ID).sum()) == entry["n_docs"] and tokens[-1] == EOS_ID
    # (the shard verification cache appears once TokenData has opened the directory)
    names = [p.name for p in stdlib_dir.iterdir() if p.name != VERIFY_FILE]
    assert sorted(names) == ["documents.jsonl", "manifest.json", "tokenizer.json", "train_000.bin",
                             "train_001.bin", "train_002.bin", "train_003.bin", "train_004.bin",
                             "val_000.bin"]


def _file_of(piece: str) -> str:
    """The file a document piece comes from (``name#first-last`` names a run of chunks)."""
    return piece.split("#")[0]


def test_documents_decode_back_to_the_stdlib_files(stdlib_dir: Path) -> None:
    """Every document's tokens, found through documents.jsonl, decode to its piece of a file, and
    the pieces of a file, in order, to the whole file (the last one to the first bytes that fit
    the 300 KB budget)."""
    tokenizer = load_tokenizer(stdlib_dir / "tokenizer.json")
    docs = read_documents(stdlib_dir)
    streams = {s: split_tokens(stdlib_dir, s) for s in ("train", "val")}
    assert sum(d["n_bytes"] for d in docs) == 300_000
    files = list(dict.fromkeys(_file_of(d["name"]) for d in docs))
    assert files == sorted(files)
    texts: dict[str, str] = {}
    for doc in docs:
        ids = streams[doc["split"]][doc["offset"]: doc["offset"] + doc["n_tokens"]]
        assert ids[-1] == EOS_ID and EOS_ID not in ids[:-1]
        text = tokenizer.decode(ids[:-1].tolist())
        assert len(text.encode("utf-8")) == doc["n_bytes"]
        texts[_file_of(doc["name"])] = texts.get(_file_of(doc["name"]), "") + text
    for i, name in enumerate(files):
        source = (STDLIB / name).read_text(encoding="utf-8")
        if i < len(files) - 1:
            assert texts[name] == source
        else:  # the budget cut the last document
            assert 0 < len(texts[name]) < len(source) and source.startswith(texts[name])
    assert any("#" in d["name"] for d in docs)  # long files gave val a chunk, train the rest
    # a stretch from the middle of a train shard decodes to text found in one of the files
    stretch = tokenizer.decode(streams["train"][40_000:40_060].tolist())
    assert len(stretch) > 60 and any(stretch in text for text in texts.values())


def test_split_is_disjoint_non_empty_and_deterministic(stdlib_dir: Path, tmp_path: Path) -> None:
    docs = read_documents(stdlib_dir)
    train = {d["name"] for d in docs if d["split"] == "train"}
    val = {d["name"] for d in docs if d["split"] == "val"}
    assert train and val and not train & val
    assert len(train) + len(val) == len(docs)
    assert len({_file_of(name) for name in train | val}) == 13
    m = _manifest(stdlib_dir)
    assert (m["splits"]["train"]["n_docs"], m["splits"]["val"]["n_docs"]) == (len(train), len(val))
    assert m["splits"]["train"]["n_bytes"] == sum(d["n_bytes"] for d in docs if d["split"] == "train")

    again = tmp_path / "again"
    prepare("stdlib", again, **STDLIB_ARGS)
    assert (again / "documents.jsonl").read_bytes() == (stdlib_dir / "documents.jsonl").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (stdlib_dir / "tokenizer.json").read_bytes()
    for split in ("train", "val"):
        assert np.array_equal(split_tokens(again, split), split_tokens(stdlib_dir, split))

    other_seed = tmp_path / "seed3"
    prepare("stdlib", other_seed, **STDLIB_ARGS, seed=3)
    val3 = {d["name"] for d in read_documents(other_seed) if d["split"] == "val"}
    assert val3 and val3 != val


def test_tiny_corpus_still_gets_a_val_document(real_docs: Docs, tmp_path: Path) -> None:
    """Two documents and val_frac=0.02: the hash rule alone would put both in train."""
    folder = doc_folder(tmp_path / "two", real_docs[:2])
    m = prepare(str(folder), tmp_path / "out", vocab_size=300, val_frac=0.02)
    assert (m["splits"]["train"]["n_docs"], m["splits"]["val"]["n_docs"]) == (1, 1)


def test_literal_end_of_text_in_a_document_is_plain_text(tmp_path: Path) -> None:
    """archlab's own tokenizer module mentions <|endoftext|>; it must not become id 0."""
    folder = tmp_path / "src"
    folder.mkdir()
    tokenizer_src = Path(__file__).parents[2] / "src" / "archlab" / "data" / "tokenizer.py"
    for path in (tokenizer_src, tokenizer_src.with_name("loader.py")):
        (folder / path.name).write_text(path.read_text())
    assert "<|endoftext|>" in (folder / "tokenizer.py").read_text()
    m = prepare(str(folder), tmp_path / "out", vocab_size=400, val_frac=0.5)
    for split in ("train", "val"):  # id 0 only at the end of each document (piece of a file)
        assert int((split_tokens(tmp_path / "out", split) == EOS_ID).sum()) == m["splits"][split]["n_docs"]


def test_overwrite_replaces_and_leaves_nothing_behind(real_docs: Docs, tmp_path: Path) -> None:
    folder = doc_folder(tmp_path / "docs", real_docs)
    out = tmp_path / "out"
    first = prepare(str(folder), out, vocab_size=300)
    second = prepare(str(folder), out, vocab_size=400, overwrite=True)
    assert _manifest(out) == second and second["vocab_size"] == 400 != first["vocab_size"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "out"]  # no temp or old dirs


def test_interrupted_overwrite_keeps_the_old_data(real_docs: Docs, tmp_path: Path) -> None:
    folder = doc_folder(tmp_path / "docs", real_docs)
    out = tmp_path / "out"
    prepare(str(folder), out, vocab_size=300)
    before = snapshot(out)

    def interrupt(stage: str, done: int, total: int | None) -> None:
        if stage == "encoding":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(str(folder), out, vocab_size=400, overwrite=True, progress=interrupt)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "out"]
