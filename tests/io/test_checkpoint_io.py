"""Checkpoint writing: leftovers of killed processes are removed, a full disk is one line and
leaves the previous checkpoint as it was."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from archlab.errors import DiskFull
from archlab.io import checkpoint as ckpt_io
from archlab.io.temporaries import temporary_path
from tests.conftest import SMALL
from tests.helpers import run_cli, small_filesystem


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The id of a process that has exited (and, being this quick, not been reused)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(proc.stdout)


def _write(target: Path, value: float) -> Path:
    return ckpt_io.write_checkpoint(target, {"model": {"w": torch.full((4,), value)}}, {"step": 1})


def _leftover(path: Path, files: dict[str, str] | None = None) -> Path:
    """A directory (with ``files``) or, given none, a file standing in for a killed writer's temporary."""
    if files is None:
        path.write_text("partial")
    else:
        path.mkdir()
        for name, text in files.items():
            (path / name).write_text(text)
    return path


def test_writing_a_checkpoint_removes_temporaries_of_dead_processes_only(tmp_path, dead_pid):
    root = tmp_path / "ckpt"
    _write(root / "step_0000001", 1.0)
    (root / "latest").write_text("step_0000001\n")
    stale = [
        _leftover(temporary_path(root / "step_0000002", "tmp", pid=dead_pid), {"model.safetensors": "x"}),
        _leftover(temporary_path(root / "latest", "tmp", pid=dead_pid)),
        # the names written before temporaries carried the host
        _leftover(root / f".step_0000002.tmp{dead_pid}", {"model.safetensors": "x"}),
        _leftover(root / f".latest.tmp{dead_pid}"),
        # a parked copy of a checkpoint that was replaced completely
        _leftover(temporary_path(root / "step_0000001", "old", pid=dead_pid), {"state.json": "{}"}),
    ]
    alive = [
        _leftover(temporary_path(root / "step_0000003", "tmp"), {"model.safetensors": "x"}),  # this process
        _leftover(root / f".step_0000003.tmp-otherhost-{dead_pid}-0123abcd", {"a": "x"}),  # another machine's
        _leftover(root / ".notes.tmp12", {"a": "x"}),  # not a name checkpoints use
    ]
    _write(root / "step_0000002", 2.0)
    left = sorted(p.name for p in root.iterdir())
    assert [p.name for p in stale if p.name in left] == []
    assert [p.name for p in alive if p.name not in left] == []
    assert ckpt_io.load_tensors(root / "step_0000002", "model")["w"].tolist() == [2.0] * 4


def test_a_copy_parked_by_a_killed_replacement_is_put_back(tmp_path, dead_pid):
    root = tmp_path / "ckpt"
    _write(root / "step_0000001", 1.0)
    # killed between "move the old copy aside" and "move the new one in": the name is empty
    parked = temporary_path(root / "step_0000001", "old", pid=dead_pid)
    (root / "step_0000001").rename(parked)
    assert ckpt_io.remove_stale_temporaries(root) == []
    assert not parked.exists()
    assert ckpt_io.read_state(root / "step_0000001")["step"] == 1


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device"),
    # what safetensors itself raises on a full disk
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
])
def test_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_last_one(failure, stdlib_data, tmp_path,
                                                                           monkeypatch, capsys):
    real_save = ckpt_io.save_file

    def save_file(tensors, path):
        if "step_0000004" in path:
            Path(path).write_bytes(b"partial")
            raise failure
        real_save(tensors, path)

    monkeypatch.setattr(ckpt_io, "save_file", save_file)
    run = tmp_path / "run"
    sets = [*SMALL, f"data.path={stdlib_data}", "train.steps=4", "train.ckpt_every=2", "train.eval_every=2"]
    code, _, err = run_cli(capsys, "train", "--out", str(run), *sum((["--set", s] for s in sets), []))
    assert code == 1, err
    [line] = err.strip().splitlines()
    root = run / "ckpt"
    assert "no space left on device" in line and "step_0000004" in line and "model.safetensors" in line
    assert f"the last checkpoint, {root / 'step_0000002'}, is kept" in line
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000002"]  # no temporary left
    assert (root / "latest").read_text().strip() == "step_0000002"
    model, _, ck = ckpt_io.load_model(run)
    assert ck == root / "step_0000002"


def test_full_disk_while_replacing_a_small_file_keeps_it(tmp_path, monkeypatch):
    target = tmp_path / "latest"
    target.write_text("step_0000002\n")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_io.os, "fsync", full)
    with pytest.raises(DiskFull, match=f"{target} is unchanged"):
        ckpt_io.atomic_write_text(target, "step_0000004\n")
    assert target.read_text() == "step_0000002\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_a_real_full_disk_keeps_the_last_checkpoint_and_a_dead_writers_leftover_is_freed(tmp_path, dead_pid):
    # a 1 MB tmpfs: the kernel's own ENOSPC, no simulation
    def weights(kb: int) -> dict[str, dict[str, torch.Tensor]]:
        return {"model": {"w": torch.ones(kb * 256)}}  # kb KB of float32

    with small_filesystem(tmp_path / "fs", 1024) as fs:
        root = fs / "ckpt"
        ckpt_io.write_checkpoint(root / "step_0000001", weights(300), {"step": 1})
        ckpt_io.atomic_write_text(root / "latest", "step_0000001\n")
        with pytest.raises(DiskFull) as full:
            ckpt_io.write_checkpoint(root / "step_0000002", weights(800), {"step": 2})
        message = str(full.value)
        assert "\n" not in message and message.startswith("no space left on device: writing ")
        assert str(root) in message and "step_0000002" in message
        assert f"the last checkpoint, {root / 'step_0000001'}, is kept" in message
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000001"]  # nothing left behind
        assert ckpt_io.read_state(root / "step_0000001")["step"] == 1  # checksums verified
        # a killed writer's temporary now fills the disk: the next write removes it first, so a
        # retry succeeds instead of failing for ever
        leftover = _leftover(temporary_path(root / "step_0000003", "tmp", pid=dead_pid), {})
        (leftover / "model.safetensors").write_bytes(b"x" * 600 * 1024)
        ckpt_io.write_checkpoint(root / "step_0000003", weights(300), {"step": 3})
        assert not leftover.exists()
        assert ckpt_io.load_tensors(root / "step_0000003", "model")["w"].numel() == 300 * 256


def test_temporaries_are_named_as_prepared_data_names_them(tmp_path, dead_pid):
    # Either cleanup reads the other's names: a dead prepare's build beside a checkpoint goes too.
    from archlab.data.prepare import remove_stale_temporaries as prepare_cleanup
    from archlab.data.prepare import temporary_path as prepare_temporary

    theirs = _leftover(prepare_temporary(tmp_path / "data", "tmp", pid=dead_pid), {"x.bin": "x"})
    assert ckpt_io.remove_stale_temporaries(tmp_path) == [theirs]
    ours = _leftover(temporary_path(tmp_path / "step_0000001", "tmp", pid=dead_pid), {"x.bin": "x"})
    assert prepare_cleanup(tmp_path / "data") == [ours]


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_weights_only_load_equals_the_saved_model_and_checks_what_it_reads(tiny_run, tmp_path):
    """load_model builds without drawing an init (every tensor is loaded): the loaded model equals
    the trained one tensor for tensor, and the global RNG is not what makes it so. It hashes the
    weights it reads, not the optimizer's moments, which the resume path still checks."""
    import shutil

    from archlab.model import build_model

    step = tmp_path / "step"
    shutil.copytree(tiny_run / "ckpt" / "step_0000006", step)
    saved = ckpt_io.load_tensors(step, "model")
    torch.manual_seed(123)
    model, cfg, _ = ckpt_io.load_model(step)
    torch.manual_seed(456)
    again, _, _ = ckpt_io.load_model(step)
    for name, t in ckpt_io.model_tensors(model).items():
        assert torch.equal(t, saved[name]), name
        assert torch.equal(t, ckpt_io.model_tensors(again)[name]), name
    fresh = build_model(cfg.model)  # the init functions are back once the load is done
    assert not torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert fresh.lm_head.weight.std() > 0

    _corrupt(step / "optim.safetensors")
    ckpt_io.load_model(step)  # weights-only: the optimizer file is not read, so not hashed
    with pytest.raises(ckpt_io.CheckpointError, match="optim.safetensors does not match"):
        ckpt_io.read_state(step)  # what a resume reads
    _corrupt(step / "model.safetensors")
    with pytest.raises(ckpt_io.CheckpointError, match="model.safetensors does not match"):
        ckpt_io.load_model(step)
    shutil.rmtree(step)
    shutil.copytree(tiny_run / "ckpt" / "step_0000006", step)
    (step / "optim.safetensors").unlink()  # unread, but still named by state.json: not a checkpoint as written
    with pytest.raises(ckpt_io.CheckpointError, match="optim.safetensors is missing"):
        ckpt_io.load_model(step)


def test_init_skipped_restores_the_init_functions_after_an_error():
    before = torch.nn.init.normal_
    with pytest.raises(RuntimeError), ckpt_io.init_skipped():
        assert torch.nn.init.normal_ is not before
        raise RuntimeError("boom")
    assert torch.nn.init.normal_ is before
    assert torch.nn.init.normal_(torch.zeros(1000)).std() > 0.5
