"""`archlab data prepare` / `archlab data info` through argparse, as the main CLI wires them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from archlab.data import cli
from archlab.errors import DataError

Docs = list[tuple[str, str]]


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="archlab")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_prepare_then_info(real_docs: Docs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"name": n, "doc": t}) + "\n" for n, t in real_docs))
    out = tmp_path / "out"
    assert _run(["data", "prepare", "--source", str(src), "--field", "doc", "--out", str(out),
                 "--vocab-size", "300", "--val-frac", "0.2", "--seed", "5"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sources"][0]["field"] == "doc" and manifest["split"]["seed"] == 5
    assert manifest["vocab_size"] == 300
    printed = capsys.readouterr().out
    assert f"prepared {out} in " in printed

    assert _run(["data", "info", str(out)]) == 0
    info = capsys.readouterr().out
    for split in ("train", "val"):
        entry = manifest["splits"][split]
        assert f"{entry['n_tokens']:,}" in info and f"{entry['n_bytes'] / entry['n_tokens']:.3f}" in info
    assert manifest["tokenizer"]["sha256"] in info.replace("\n", "").replace("│", "").replace(" ", "")
    assert "jsonl" in info and "doc / train" not in info  # a JSONL source has a field, no split


def test_max_mb_limits_the_stdlib(tmp_path: Path) -> None:
    out = tmp_path / "std"
    assert _run(["data", "prepare", "--out", str(out), "--max-mb", "0.1", "--vocab-size", "300"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sources"][0]["max_bytes"] == 100_000
    assert sum(manifest["splits"][s]["n_bytes"] for s in ("train", "val")) == 100_000


def test_user_errors_are_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist; run `archlab data prepare"):
        _run(["data", "info", str(tmp_path / "missing")])
    with pytest.raises(DataError, match="does not exist"):
        _run(["data", "prepare", "--source", str(tmp_path / "nothing.jsonl"), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):  # argparse rejects an unknown format itself
        _run(["data", "prepare", "--format", "csv"])


def test_an_interrupted_prepare_says_nothing_was_written(real_docs: Docs, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """Ctrl-C while prepare replaces a directory: one line saying the output is as it was (not the
    training line about finished work and checkpoints), exit 130, no temporary left beside it."""
    import importlib
    import os
    import signal
    import time

    prepare_mod = importlib.import_module("archlab.data.prepare")  # the package exports a function of that name
    from tests.data.data_testutil import snapshot
    from tests.helpers import run_cli

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"name": n, "doc": t}) + "\n" for n, t in real_docs))
    out = tmp_path / "out"
    argv = ["data", "prepare", "--source", str(src), "--field", "doc", "--out", str(out), "--vocab-size", "300",
            "--val-frac", "0.2"]
    assert _run(argv) == 0
    before = snapshot(out)

    def interrupted(tmp: Path, dest: Path) -> None:  # the whole build done, about to be installed
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)  # the signal's KeyboardInterrupt ends this at once

    monkeypatch.setattr(prepare_mod, "_install", interrupted)
    capsys.readouterr()
    code, stdout, err = run_cli(capsys, *argv, "--overwrite", "--seed", "3")
    assert code == 130 and stdout == "" and len(err.strip().splitlines()) == 1, err  # (the bar's blank line aside)
    assert f"archlab: interrupted; nothing was written: {out} is as it was before" in err
    assert "checkpoint" not in err and "finished work" not in err
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "out"]
