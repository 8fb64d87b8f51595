"""One writer per run directory (``archlab.io.run_dir.claim_run_dir``): a second trainer is refused
with one line naming the holder and writes nothing, a killed holder's directory is taken over and
resumed, and where the file system has no locks the holder's record decides. Real processes and
real signals."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from archlab.io import run_dir
from archlab.io.owner import Owner, process_started
from archlab.io.run_dir import LOCK_FILE, RunDirBusy, claim_run_dir
from archlab.train.trainer import train
from tests.conftest import SMALL, small_config


def _files(out: Path) -> dict[str, bytes]:
    """Every file under ``out`` with its bytes: what "writes nothing" is checked against."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _train_cli(data: Path, out: Path, *extra: str) -> list[str]:
    sets = [a for o in [*SMALL, f"data.path={data}", *extra] for a in ("--set", o)]
    return [sys.executable, "-m", "archlab.cli", "train", "--out", str(out), *sets]


def _wait_for(check, what: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, f"{what}: the process exited ({proc.returncode}): {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_second_trainer_is_refused_and_a_killed_ones_run_resumes(stdlib_data, tmp_path):
    out = tmp_path / "run"
    extra = ("train.steps=5000", "train.ckpt_every=2", "train.eval_every=5000", "train.log_every=1",
             "train.threads=1")
    first = subprocess.Popen(_train_cli(stdlib_data, out, *extra), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (out / "ckpt" / "latest").exists(), "the first checkpoint", first)
        first.send_signal(signal.SIGSTOP)  # alive and holding the directory, but writing nothing now
        before = _files(out)
        second = subprocess.run(_train_cli(stdlib_data, out, *extra), capture_output=True, text=True)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 1 and len(lines) == 1, second.stderr
        assert f"{out} is being trained by pid {first.pid} on {socket.gethostname()} since " in lines[0]
        assert "train into another --out" in lines[0]
        assert _files(out) == before  # the refused trainer wrote nothing
    finally:
        first.send_signal(signal.SIGKILL)  # a stopped process dies of SIGKILL too
        first.wait()

    # The kernel released the dead holder's lock; its record says who it was.
    step = int((out / "ckpt" / "latest").read_text().strip().removeprefix("step_"))
    notes: list[str] = []
    res = train(small_config(stdlib_data, *extra), out, stop_after_steps=1, show_progress=False,
                notify=notes.append)
    assert res.steps == step + 1
    assert any(f"was being trained by pid {first.pid}" in n and "taking the run directory over" in n
               for n in notes), notes
    assert f"resuming from step {step} of {out}" in notes
    assert (out / LOCK_FILE).read_bytes() == b""  # released cleanly: no holder on record


def test_a_trainer_in_this_process_is_refused_before_it_writes(stdlib_data, tmp_path):
    out = tmp_path / "run"
    with claim_run_dir(out, notify=lambda line: None):
        with pytest.raises(RunDirBusy, match=rf"being trained by pid {os.getpid()} on .* since ") as e:
            train(small_config(stdlib_data, "train.steps=2"), out, show_progress=False)
        assert "\n" not in str(e.value)
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    train(small_config(stdlib_data, "train.steps=2"), out, show_progress=False)  # released: free again
    assert (out / "ckpt" / "latest").is_file()


def test_without_file_locks_the_holders_record_decides(tmp_path, monkeypatch):
    """Some FUSE and network file systems answer flock with ENOLCK: a holder on this host is live
    while its process exists, one on another host cannot be checked and is left to the user."""
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_dir.fcntl, "flock", no_locks)
    out = tmp_path / "run"
    with claim_run_dir(out, notify=lambda line: None):  # the lock file and its record exist now
        pass
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    me = Owner.current()
    try:
        live = Owner(pid=holder.pid, host=me.host, boot=me.boot, started=process_started(holder.pid))
        for who in (live, Owner(pid=1, host="elsewhere", boot="", started="")):
            _record(out, who)
            with pytest.raises(RunDirBusy, match=rf"pid {who.pid} on {who.host} .* delete {out / LOCK_FILE}"):
                with claim_run_dir(out, notify=lambda line: None):
                    pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    _record(out, live)  # its process is gone now: taken over, and said so
    notes: list[str] = []
    with claim_run_dir(out, notify=notes.append):
        assert str(os.getpid()) in (out / LOCK_FILE).read_text()
    assert len(notes) == 1 and f"pid {holder.pid}" in notes[0] and "ended without releasing it" in notes[0]


def _record(out: Path, who: Owner) -> None:
    fd = os.open(out / LOCK_FILE, os.O_RDWR)
    try:
        run_dir._write_record(fd, who)
    finally:
        os.close(fd)
