"""Text that is not UTF-8: undecodable bytes are counted and reported (manifest, summary, one
warning line), ``--encoding`` reads such files right, and byte counts are the UTF-8 of the text.

The fixture is a folder (or a JSONL file) of Latin-1 bytes written in tmp_path: the opening
sentences of three public-domain French novels.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from archlab.cli import main as archlab_main
from archlab.data import TokenData, prepare
from archlab.data.decoding import decode, text_encoding
from archlab.data.sources import open_source
from archlab.errors import DataError
from tests.data.data_testutil import read_documents, split_tokens
from tests.data.recipes_testutil import run_cli

FRENCH = {
    "hugo": "En 1815, M. Charles-François-Bienvenu Myriel était évêque de Digne. C'était un vieillard "
            "d'environ soixante-quinze ans ; il occupait le siège de Digne depuis 1806.",
    "flaubert": "Nous étions à l'Étude, quand le Proviseur entra, suivi d'un nouveau habillé en "
                "bourgeois et d'un garçon de classe qui portait un grand pupitre.",
    "verne": "L'année 1866 fut marquée par un événement bizarre, un phénomène inexpliqué et "
             "inexplicable que personne n'a sans doute oublié.",
}
# Each accented letter is one Latin-1 byte, and none is followed by a UTF-8 continuation byte:
# read as UTF-8, each is exactly one undecodable byte.
ACCENTED = sum(1 for text in FRENCH.values() for c in text if ord(c) > 127)


def _latin1_folder(root: Path) -> Path:
    root.mkdir()
    for name, text in FRENCH.items():
        (root / f"{name}.txt").write_bytes(text.encode("latin-1"))
    return root


def _latin1_jsonl(path: Path) -> Path:
    path.write_bytes(b"".join(json.dumps({"text": t}, ensure_ascii=False).encode("latin-1") + b"\n"
                              for t in FRENCH.values()))
    return path


def _disk_bytes(source: Path) -> int:
    return sum(p.stat().st_size for p in source.glob("*.txt"))


def test_undecodable_bytes_are_counted_per_source(tmp_path: Path) -> None:
    assert ACCENTED == 19
    for src in (_latin1_folder(tmp_path / "fr"), _latin1_jsonl(tmp_path / "fr.jsonl")):
        source = open_source(str(src))
        docs = list(source.documents())
        assert len(docs) == 3 and all("\ufffd" in t for _, t in docs)
        assert source.decoding.replaced_bytes == ACCENTED
        entry = source.describe()
        assert entry["encoding"] == "utf-8" and entry["replaced_bytes"] == ACCENTED
        assert entry["replaced_files"] == (3 if src.is_dir() else 1)
        list(source.documents())  # a second pass counts again, it does not add up
        assert source.decoding.replaced_bytes == ACCENTED
    assert decode("évêque".encode("latin-1"), "utf-8") == ("\ufffdv\ufffdque", 2)
    assert decode("évêque".encode("utf-8"), "utf-8") == ("évêque", 0)


def test_prepare_warns_once_and_records_the_replaced_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # rich tables unwrapped
    folder = _latin1_folder(tmp_path / "fr")
    out = tmp_path / "out"
    assert run_cli(["data", "prepare", "--source", str(folder), "--out", str(out), "--vocab-size", "300",
                    "--val-frac", "0.3"]) == 0
    captured = capsys.readouterr()
    # (the transient progress bar leaves a blank line on stderr)
    assert [line for line in captured.err.splitlines() if line.strip()] == [
        f"warning: {ACCENTED} bytes of {folder} in 3 file(s) (e.g. flaubert.txt) are not valid utf-8 "
        "and were replaced by U+FFFD; if the files use another encoding, prepare again with --encoding "
        "(e.g. latin-1 or cp1252) and --overwrite"]
    assert f"utf-8, {ACCENTED} bytes replaced" in captured.out  # the summary's sources table
    manifest = json.loads((out / "manifest.json").read_text())
    (entry,) = manifest["sources"]
    assert (entry["encoding"], entry["replaced_bytes"]) == ("utf-8", ACCENTED)
    assert entry["replaced_examples"] == ["flaubert.txt", "hugo.txt", "verne.txt"]
    # what the user saw: each replaced byte counts as the 3 UTF-8 bytes of U+FFFD
    n_bytes = sum(manifest["splits"][s]["n_bytes"] for s in ("train", "val"))
    assert n_bytes == _disk_bytes(folder) + 2 * ACCENTED


@pytest.mark.parametrize("codec, canonical", [("latin-1", "iso8859-1"), ("cp1252", "cp1252")])
@pytest.mark.parametrize("kind", ["folder", "jsonl"])
def test_encoding_reads_latin1_right(codec: str, canonical: str, kind: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    src = _latin1_folder(tmp_path / "fr") if kind == "folder" else _latin1_jsonl(tmp_path / "fr.jsonl")
    out = tmp_path / "out"
    assert run_cli(["data", "prepare", "--source", str(src), "--out", str(out), "--vocab-size", "300",
                    "--val-frac", "0.3", "--encoding", codec]) == 0
    assert capsys.readouterr().err.strip() == ""  # nothing replaced, nothing to warn about
    manifest = json.loads((out / "manifest.json").read_text())
    (entry,) = manifest["sources"]
    assert (entry["encoding"], entry["replaced_bytes"]) == (canonical, 0) and "replaced_files" not in entry
    # bytes are the UTF-8 of the text (an accented letter: 1 byte on disk, 2 counted)
    n_bytes = sum(manifest["splits"][s]["n_bytes"] for s in ("train", "val"))
    assert n_bytes == sum(len(t.encode("utf-8")) for t in FRENCH.values())
    if kind == "folder":
        assert n_bytes == _disk_bytes(src) + ACCENTED
    # the tokens decode to the sentences exactly, and bytes per token uses the same count
    data = TokenData(out)
    streams = {s: split_tokens(out, s) for s in ("train", "val")}
    decoded = sorted(data.tokenizer.decode(streams[d["split"]][d["offset"]: d["offset"] + d["n_tokens"] - 1]
                                           .tolist()) for d in read_documents(out))
    assert decoded == sorted(FRENCH.values())
    assert data.bytes_per_token("train") == (manifest["splits"]["train"]["n_bytes"]
                                             / manifest["splits"]["train"]["n_tokens"])


def test_unknown_encoding_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _latin1_folder(tmp_path / "fr")
    out = tmp_path / "out"
    for bad in ("klingon", "base64"):  # base64 is a codec, but not a text encoding
        with pytest.raises(SystemExit) as exit_:
            archlab_main(["data", "prepare", "--source", str(folder), "--out", str(out), "--encoding", bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"unknown text encoding {bad!r} (--encoding)" in err
    assert not out.exists()
    with pytest.raises(DataError, match="unknown text encoding 'klingon'"):
        prepare(str(folder), out, vocab_size=300, encoding="klingon")
    assert text_encoding("Latin-1") == "iso8859-1" and text_encoding("UTF8") == "utf-8"


def test_encoding_applies_to_text_and_jsonl_only(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"--encoding applies to text and JSONL files; the stdlib source "
                                        r"is Python files, which are UTF-8 \(got --encoding iso8859-1\)"):
        open_source("stdlib", encoding="latin-1")
    with pytest.raises(DataError, match="--encoding apply to --source, not to --recipe"):
        run_cli(["data", "prepare", "--recipe", "shakespeare", "--encoding", "cp1252",
                 "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
