"""prepare's temporary directories: leftovers of dead runs are removed on the next prepare, and a
full disk is one DataError line naming the path, with no temporary left and old data untouched."""

from __future__ import annotations

import errno
import importlib
import io
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from archlab.cli import main as archlab_main
from archlab.data import prepare
from archlab.errors import DataError
from tests.data.data_testutil import doc_folder, snapshot
from tests.helpers import small_filesystem

Docs = list[tuple[str, str]]
# The module (archlab.data.prepare, as an attribute, is the function of that name).
prep = importlib.import_module("archlab.data.prepare")


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_stale_temporaries_of_dead_runs_are_removed(real_docs: Docs, tmp_path: Path) -> None:
    docs = doc_folder(tmp_path / "docs", real_docs)
    work = tmp_path / "work"
    work.mkdir()
    out, other = work / "out", work / "other"
    dead = _dead_pid()
    stale = prep.temporary_path(out, "tmp", pid=dead)
    stale.mkdir()
    (stale / "train_000.bin").write_bytes(np.arange(1000, dtype=np.uint16).tobytes())
    stale_other = prep.temporary_path(other, "tmp", pid=dead)  # another output's: also dead
    stale_other.mkdir()
    legacy_old = work / ".out.tmp-0badc0de"  # the naming before pids: removed once 6 h old
    legacy_old.mkdir()
    os.utime(legacy_old, (time.time() - 7 * 3600,) * 2)
    kept = {
        prep.temporary_path(out, "tmp").name,  # this process is alive
        ".out.tmp-otherhost-%d-0123abcd" % dead,  # another host's pid says nothing here
        ".out.tmp-1badc0de",  # legacy, but recent: may belong to a run in progress
        prep.temporary_path(out, "old", pid=dead).name,  # out is missing: maybe the only copy
    }
    for name in kept:
        (work / name).mkdir()
    (work / ".out.tmp-2badc0de").write_text("a file, not a directory we made")
    kept.add(".out.tmp-2badc0de")

    prepare(str(docs), out, vocab_size=300)
    assert _hidden(work) == sorted(kept)
    assert not stale.exists() and not stale_other.exists() and not legacy_old.exists()
    assert (out / "manifest.json").is_file()


class _FullDisk(io.FileIO):
    """A shard file on a disk that fills after ``room`` bytes: writes then fail with ENOSPC, and
    so does the first close, as a buffered file's close does when it cannot flush."""

    room = 3000

    def __init__(self, path: Path) -> None:
        super().__init__(path, "wb")
        self.closes = 0

    def write(self, data) -> int:  # type: ignore[override]
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)

    def close(self) -> None:
        super().close()
        self.closes += 1
        if self.closes == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_is_one_line_and_keeps_the_old_data(real_docs: Docs, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    docs = doc_folder(tmp_path / "docs", real_docs)
    out = tmp_path / "out"
    prepare(str(docs), out, vocab_size=300)
    before = snapshot(out)

    monkeypatch.setattr(prep, "open_shard", _FullDisk)
    with pytest.raises(DataError) as failed:
        prepare(str(docs), out, vocab_size=400, overwrite=True)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"no space left on device: writing {tmp_path}/.out.tmp-")
    assert message.split(" failed, ")[0].endswith("/train_000.bin")
    assert message.endswith(" failed, its file system is full; free some space there (or choose "
                            "another --out) and re-run `archlab data prepare`; the prepared data "
                            f"already in {out} is unchanged")
    assert snapshot(out) == before  # byte-identical, mtimes too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "out"]  # no temporary left


def test_full_disk_through_the_cli(real_docs: Docs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    docs = doc_folder(tmp_path / "docs", real_docs)
    monkeypatch.setattr(prep, "open_shard", _FullDisk)
    code = archlab_main(["data", "prepare", "--source", str(docs), "--out", str(tmp_path / "new"),
                         "--vocab-size", "300"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(err) == 1
    assert err[0].startswith("archlab: no space left on device: writing ")
    assert err[0].endswith("; nothing was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs"]


def test_a_real_full_disk_keeps_the_old_data_and_a_dead_runs_leftover_is_freed(
        real_docs: Docs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a 96 KB tmpfs holds one prepared copy of these documents (about 64 KB in pages), not two:
    # the kernel's own ENOSPC, no simulation
    docs = doc_folder(tmp_path / "docs", real_docs)
    with small_filesystem(tmp_path / "fs", 96) as fs:
        out = fs / "out"
        prepare(str(docs), out, vocab_size=300)
        before = snapshot(out)
        code = archlab_main(["data", "prepare", "--source", str(docs), "--out", str(out), "--vocab-size", "400",
                             "--overwrite"])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 1 and len(err) == 1, err
        assert err[0].startswith(f"archlab: no space left on device: writing {fs}/.out.tmp-")
        assert err[0].endswith(f"the prepared data already in {out} is unchanged")
        assert snapshot(out) == before
        assert sorted(p.name for p in fs.iterdir()) == ["out"]  # no temporary left to keep the disk full
        # a killed prepare's temporary fills the disk: the next prepare removes it first, so the
        # retry succeeds instead of failing for ever
        for p in out.iterdir():
            p.unlink()
        out.rmdir()
        leftover = prep.temporary_path(out, "tmp", pid=_dead_pid())
        leftover.mkdir()
        (leftover / "train_000.bin").write_bytes(b"\0" * 60 * 1024)
        prepare(str(docs), out, vocab_size=300)
        assert not leftover.exists() and (out / "manifest.json").is_file()


def test_discard_never_raises(tmp_path: Path) -> None:
    writer = prep.ShardWriter(tmp_path, "train", np.dtype(np.uint16), shard_tokens=10_000)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prep, "open_shard", _FullDisk)
        writer.add(np.arange(100, dtype=np.uint16), 300)  # fits: the shard stays open
        writer.discard()  # its close fails with ENOSPC; discard swallows that
    assert writer.shards == [{"file": "train_000.bin"}]
    writer.discard()  # and again, with nothing open
