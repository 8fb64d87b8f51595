"""An output path that cannot be written (a read-only file system, no permission, a full disk) ends
every writing command with one line naming the path and the reason, a non-zero exit and no
traceback, and leaves what was already there as it was.

Two ways to refuse a path. ``refused_tree`` makes every write under a folder fail in this process
as the kernel fails it on a read-only mount (the same errno, the same file named); it runs
everywhere, also as root, where permission bits do not stop writes. ``read_only_mount`` is the
real thing, a tmpfs remounted read-only, and is skipped where this machine cannot mount one.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import io
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from archlab.errors import DiskFull, Unwritable, unwritable_path
from archlab.io.temporaries import destination, temporary_path
from tests.conftest import SMALL
from tests.helpers import run_cli

SETS = sum((["--set", s] for s in SMALL), [])
# Conversions and exports write ordinary checkpoints; training runs these few steps.
TRAIN_STEPS = ["--set", "train.steps=4", "--set", "train.ckpt_every=2", "--set", "train.eval_every=2"]


# ---- refusing writes --------------------------------------------------------------------------
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class _Refusal:
    """Which paths are refused, and how: the errno a read-only mount (EROFS) or a folder this
    user may not write (EACCES) gives, with the file named as the kernel names it."""

    def __init__(self, root: Path, code: int) -> None:
        self.root, self.code = os.path.abspath(root), code

    def covers(self, path, dir_fd: int | None = None) -> bool:
        if isinstance(path, int):
            return False  # an open descriptor: it was checked when it was opened
        name = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(name):  # shutil.rmtree names entries by folder
            name = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)
        name = os.path.abspath(name)
        return name == self.root or name.startswith(self.root + os.sep)

    def error(self, path) -> OSError:
        return OSError(self.code, os.strerror(self.code), os.fsdecode(path))


@contextlib.contextmanager
def refused_tree(monkeypatch: pytest.MonkeyPatch, root: Path, code: int = errno.EROFS) -> Iterator[Path]:
    """Every write under ``root`` (creating, truncating, appending, renaming, removing) fails with
    ``code`` for the block; reads work. Native writers (safetensors, SQLite, tokenizers) are not
    intercepted, but every command creates the file or folder they write into first, in Python."""
    refusal = _Refusal(root, code)
    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir
    real = {name: getattr(os, name) for name in ("rmdir", "remove", "unlink")}
    real_rename, real_replace = os.rename, os.replace

    def open_(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and refusal.covers(file):
            raise refusal.error(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & _WRITE_FLAGS and refusal.covers(path, dir_fd):
            raise refusal.error(path)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    def mkdir(path, mode=0o777, *, dir_fd=None):
        # an existing folder is EEXIST even on a read-only mount (what mkdir -p relies on)
        if refusal.covers(path, dir_fd) and not os.path.lexists(path):
            raise refusal.error(path)
        return real_mkdir(path, mode, dir_fd=dir_fd)

    def removal(name: str):
        def remove(path, *, dir_fd=None):
            if refusal.covers(path, dir_fd):
                raise refusal.error(path)
            return real[name](path, dir_fd=dir_fd)
        return remove

    def moving(fn):
        def move(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
            if refusal.covers(src, src_dir_fd) or refusal.covers(dst, dst_dir_fd):
                raise refusal.error(src)
            return fn(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        return move

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", open_)
        m.setattr(io, "open", open_)  # pathlib's Path.open
        m.setattr(os, "open", os_open)
        m.setattr(os, "mkdir", mkdir)
        for name in real:
            m.setattr(os, name, removal(name))
        m.setattr(os, "rename", moving(real_rename))
        m.setattr(os, "replace", moving(real_replace))
        yield root


def _mount_tool(name: str) -> str:
    tool = shutil.which(name)
    if os.geteuid() != 0 or tool is None:
        pytest.skip("a real read-only mount needs root and mount(8); the refused_tree tests cover this")
    return tool


@contextlib.contextmanager
def read_only_mount(path: Path, *copies: tuple[Path, str]) -> Iterator[Path]:
    """A tmpfs at ``path`` holding ``copies`` (source, name inside), remounted read-only: the
    kernel's own EROFS. Skipped where this machine does not allow mounting."""
    mount, umount = _mount_tool("mount"), _mount_tool("umount")
    path.mkdir(parents=True, exist_ok=True)
    made = subprocess.run([mount, "-t", "tmpfs", "-o", "size=64m,mode=0755", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}); the refused_tree tests cover this")
    try:
        for src, name in copies:
            shutil.copytree(src, path / name, symlinks=True)
        ro = subprocess.run([mount, "-o", "remount,ro", str(path)], capture_output=True, text=True)
        if ro.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here ({ro.stderr.strip()})")
        yield path
    finally:
        subprocess.run([umount, "-l", str(path)], capture_output=True)


# ---- what every refusal must look like ----------------------------------------------------------
def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) by content: equal snapshots, nothing changed,
    added or left behind."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def assert_refused(code: int, err: str, path: Path | str, reason: str = "read-only file system",
                   notices: tuple[str, ...] = ()) -> str:
    """Exit 1, no traceback, and one line (besides the command's own ``notices``) naming ``path``
    and ``reason``; returns that line."""
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if not (notices and line.startswith(notices))]
    assert len(lines) == 1, err
    assert code == 1, err
    assert lines[0].startswith("archlab: "), lines[0]
    assert str(path) in lines[0] and reason in lines[0], lines[0]
    return lines[0]


# ---- fixtures: what the commands read ----------------------------------------------------------
@pytest.fixture(scope="module")
def interrupted_run(stdlib_data, tmp_path_factory) -> Path:
    """A run of 4 steps stopped after 2 (its checkpoint at step 2), as a kill would leave it."""
    from archlab.train.trainer import train
    from tests.conftest import small_config

    out = tmp_path_factory.mktemp("interrupted") / "run"
    cfg = small_config(stdlib_data, "train.steps=4", "train.ckpt_every=2", "train.eval_every=2")
    train(cfg, out, stop_after_steps=2, show_progress=False)
    assert (out / "ckpt" / "latest").read_text().strip() == "step_0000002"
    return out


@pytest.fixture(scope="module")
def hf_folder(tiny_run, tmp_path_factory) -> Path:
    from archlab.convert.hf_export import export_hf

    return export_hf(tiny_run, tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def fake_suite(tmp_path_factory) -> tuple[Path, Path]:
    """A finished suite (fake trainer, fake costs) with its report: (suite file, suite dir)."""
    from rich.console import Console

    from archlab.lab.plan import build_plan
    from archlab.lab.report import write_report
    from archlab.lab.runner import run_suite
    from archlab.lab.store import DB_NAME, ResultStore
    from archlab.lab.suite import load_suite
    from tests.lab.lab_fakes import FakeTrainer, fake_costs, write_suite

    tmp = tmp_path_factory.mktemp("suite")
    suite_file = write_suite(tmp)
    plan = build_plan(load_suite(suite_file), tmp / "out", costs_fn=fake_costs)
    with ResultStore(plan.out_dir / DB_NAME) as store:
        run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(), console=Console(file=open(os.devnull, "w")))
    write_report(plan.out_dir)
    return suite_file, plan.out_dir


def _resume_argv(stdlib_data: Path, run: Path) -> list[str]:
    return ["train", "--out", str(run), *SETS, "--set", f"data.path={stdlib_data}", *TRAIN_STEPS]


# ---- the mechanism -----------------------------------------------------------------------------
def test_a_temporary_is_named_as_the_path_it_stands_for(tmp_path):
    out = tmp_path / "run" / "ckpt" / "step_0000006"
    tmp = temporary_path(out, "tmp")
    assert destination(tmp) == out
    assert destination(tmp / "model.safetensors") == out / "model.safetensors"
    assert destination(temporary_path(tmp_path / "data", "old")) == tmp_path / "data"
    # names that only look alike stay as they are
    for plain in (tmp_path / ".hidden", tmp_path / ".x.tmp-1", Path("relative/.a.tmp")):
        assert destination(plain) == plain


@pytest.mark.parametrize("code,cls,words", [
    (errno.EROFS, Unwritable, "read-only file system"),
    (errno.EACCES, Unwritable, "permission denied"),
    (errno.EPERM, Unwritable, "operation not permitted"),
    (errno.ENOSPC, DiskFull, "no space left on device"),
    (errno.EDQUOT, DiskFull, "disk quota exceeded"),
])
def test_a_refused_path_is_one_line_naming_the_destination(tmp_path, code, cls, words):
    out = tmp_path / "data"
    e = unwritable_path(OSError(code, os.strerror(code), str(temporary_path(out, "tmp") / "train_000.bin")),
                        destination)
    assert type(e) is cls and e.exit_code == 1
    message = str(e)
    assert words in message and str(out / "train_000.bin") in message and ".tmp-" not in message
    assert "\n" not in message


@pytest.mark.parametrize("error", [
    OSError(errno.ENOENT, "No such file or directory", "x"),  # the code asked for a missing file
    OSError(errno.EIO, "Input/output error", "x"),            # a failing disk, not a refusal
    OSError(errno.EACCES, "Permission denied"),               # no file: a socket or another user's process
    OSError(errno.EPERM, "Operation not permitted"),
    ValueError("a bug"),
])
def test_anything_else_keeps_its_traceback(monkeypatch, capsys, error):
    import archlab.cli

    def broken(args):
        raise error

    monkeypatch.setattr(archlab.cli, "cmd_info", broken)
    if isinstance(error, OSError):
        assert unwritable_path(error) is None
    with pytest.raises(type(error)):
        archlab.cli.main(["info"])


# ---- each command, its output refused in this process ------------------------------------------
@pytest.mark.parametrize("code,reason", [(errno.EROFS, "read-only file system"), (errno.EACCES, "permission denied")])
def test_train_into_a_refused_folder(stdlib_data, tmp_path, monkeypatch, capsys, code, reason):
    root = tmp_path / "refused"
    root.mkdir()
    with refused_tree(monkeypatch, root, code):
        got, _, err = run_cli(capsys, "train", "--out", str(root / "run"), *SETS, "--set", f"data.path={stdlib_data}",
                              *TRAIN_STEPS)
    assert_refused(got, err, root / "run", reason)
    assert not any(root.iterdir())


def test_resume_into_a_run_whose_checkpoints_cannot_be_written(interrupted_run, stdlib_data, tmp_path,
                                                               monkeypatch, capsys):
    """The run trains on from step 2; writing step 4 fails: the error names that checkpoint, not
    its hidden temporary, and step 2 and ``latest`` stay exactly as they were."""
    run = tmp_path / "run"
    shutil.copytree(interrupted_run, run)
    before = snapshot(run / "ckpt")
    with refused_tree(monkeypatch, run / "ckpt"):
        got, _, err = run_cli(capsys, *_resume_argv(stdlib_data, run))
    assert_refused(got, err, run / "ckpt" / "step_0000004", notices=("resuming from step 2",))
    assert snapshot(run / "ckpt") == before


def test_resume_in_a_read_only_run_directory(interrupted_run, stdlib_data, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(interrupted_run, run)
    before = snapshot(run)
    with refused_tree(monkeypatch, run):
        got, _, err = run_cli(capsys, *_resume_argv(stdlib_data, run))
    assert_refused(got, err, run, notices=("resuming from step 2",))
    assert snapshot(run) == before


def test_data_prepare_into_a_refused_folder_and_over_existing_data(stdlib_data, tmp_path, monkeypatch, capsys):
    root = tmp_path / "refused"
    root.mkdir()
    shutil.copytree(stdlib_data, root / "kept")
    before = snapshot(root)
    prepare = ["data", "prepare", "--source", "stdlib", "--max-mb", "0.05", "--vocab-size", "300"]
    with refused_tree(monkeypatch, root):
        new = run_cli(capsys, *prepare, "--out", str(root / "new"))
        over = run_cli(capsys, *prepare, "--out", str(root / "kept"), "--overwrite")
    assert_refused(new[0], new[2], root / "new")
    line = assert_refused(over[0], over[2], root / "kept")
    assert ".tmp-" not in line  # the data directory asked for, not the one it is built in
    assert snapshot(root) == before


def test_compare_into_a_refused_folder_and_an_existing_suite(fake_suite, stdlib_data, tmp_path, monkeypatch, capsys):
    suite_file, finished = fake_suite
    root = tmp_path / "refused"
    root.mkdir()
    shutil.copytree(finished, root / "suite")
    before = snapshot(root)
    with refused_tree(monkeypatch, root):
        new = run_cli(capsys, "compare", str(suite_file), "--out", str(root / "new"), "--set",
                      f"data.path={stdlib_data}")
        existing = run_cli(capsys, "compare", str(suite_file), "--out", str(root / "suite"))
    assert_refused(new[0], new[2], root / "new")
    assert_refused(existing[0], existing[2], root / "suite")
    assert snapshot(root) == before


def test_report_into_a_refused_suite_directory(fake_suite, tmp_path, monkeypatch, capsys):
    _, finished = fake_suite
    suite = tmp_path / "suite"
    shutil.copytree(finished, suite)
    before = snapshot(suite)  # the previous report.md, report.html and figures among them
    with refused_tree(monkeypatch, suite):
        got, _, err = run_cli(capsys, "report", str(suite))
    line = assert_refused(got, err, suite / "loss_curves.png")  # the first file a report writes
    assert ".tmp" not in line
    assert snapshot(suite) == before


def test_convert_into_a_refused_folder_and_over_a_checkpoint(tiny_run, tmp_path, monkeypatch, capsys):
    root = tmp_path / "refused"
    root.mkdir()
    code, _, err = run_cli(capsys, "convert", "--to", "delta-mhar", "--ckpt", str(tiny_run), "--out",
                           str(root / "kept"))
    assert code == 0, err
    before = snapshot(root)
    with refused_tree(monkeypatch, root):
        new = run_cli(capsys, "convert", "--to", "delta-mhar", "--ckpt", str(tiny_run), "--out", str(root / "new"))
        over = run_cli(capsys, "convert", "--to", "delta-mhar", "--ckpt", str(tiny_run), "--out",
                       str(root / "kept"), "--overwrite")
    assert_refused(new[0], new[2], root / "new")
    assert_refused(over[0], over[2], root / "kept")
    assert snapshot(root) == before


def test_import_hf_into_a_refused_folder(hf_folder, tmp_path, monkeypatch, capsys):
    root = tmp_path / "refused"
    root.mkdir()
    with refused_tree(monkeypatch, root):
        got, _, err = run_cli(capsys, "import-hf", "--src", str(hf_folder), "--out", str(root / "imported"))
    assert_refused(got, err, root / "imported")
    assert not any(root.iterdir())


def test_export_hf_into_a_refused_folder(tiny_run, tmp_path, monkeypatch, capsys):
    root = tmp_path / "refused"
    root.mkdir()
    with refused_tree(monkeypatch, root):
        got, _, err = run_cli(capsys, "export-hf", "--ckpt", str(tiny_run), "--out", str(root / "hf"))
    line = assert_refused(got, err, root / "hf")
    assert ".partial" not in line and ".tmp-" not in line
    assert not any(root.iterdir())


def test_export_hf_onto_a_full_disk_names_the_weights_file(tiny_run, tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk as its own error type, not an OSError: the export still
    ends in one line naming the file of --out, and leaves no partial folder."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    got, _, err = run_cli(capsys, "export-hf", "--ckpt", str(tiny_run), "--out", str(tmp_path / "hf"))
    assert_refused(got, err, tmp_path / "hf" / "model.safetensors", "no space left on device")
    assert list(tmp_path.iterdir()) == []


# ---- the same commands on a real read-only file system -----------------------------------------
def _real_cases(stdlib_data: Path, tiny_run: Path, interrupted_run: Path, hf_folder: Path,
                fake_suite: tuple[Path, Path]) -> dict[str, tuple[list[tuple[Path, str]], list[str], str]]:
    """Per command: (what the read-only mount holds, the arguments with ``{ro}`` for the mount,
    the path the error must name)."""
    suite_file, suite = fake_suite
    return {
        "train": ([], ["train", "--out", "{ro}/run", *SETS, "--set", f"data.path={stdlib_data}", *TRAIN_STEPS],
                  "{ro}/run"),
        "resume": ([(interrupted_run, "run")], _resume_argv(stdlib_data, Path("{ro}/run")), "{ro}/run"),
        "data prepare": ([(stdlib_data, "data")], ["data", "prepare", "--source", "stdlib", "--max-mb", "0.05",
                                                  "--vocab-size", "300", "--out", "{ro}/data", "--overwrite"],
                         "{ro}/data"),
        "compare": ([], ["compare", str(suite_file), "--out", "{ro}/suite"], "{ro}/suite"),
        "report": ([(suite, "suite")], ["report", "{ro}/suite"], "{ro}/suite"),
        "convert": ([], ["convert", "--to", "delta-mhar", "--ckpt", str(tiny_run), "--out", "{ro}/conv"], "{ro}/conv"),
        "import-hf": ([], ["import-hf", "--src", str(hf_folder), "--out", "{ro}/imported"], "{ro}/imported"),
        "export-hf": ([], ["export-hf", "--ckpt", str(tiny_run), "--out", "{ro}/hf"], "{ro}/hf"),
    }


@pytest.mark.parametrize("command", ["train", "resume", "data prepare", "compare",
                                     "report",
                                     "convert", "import-hf", "export-hf"])
def test_on_a_real_read_only_file_system(command, stdlib_data, tiny_run, interrupted_run, hf_folder, fake_suite,
                                         tmp_path, capsys):
    copies, argv, named = _real_cases(stdlib_data, tiny_run, interrupted_run, hf_folder, fake_suite)[command]
    with read_only_mount(tmp_path / "ro", *copies) as ro:
        before = snapshot(ro)
        got, _, err = run_cli(capsys, *[a.replace("{ro}", str(ro)) for a in argv])
        assert_refused(got, err, named.replace("{ro}", str(ro)), notices=("resuming from step",))
        assert snapshot(ro) == before
