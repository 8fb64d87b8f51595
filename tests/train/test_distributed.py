"""Distributed training on CPU: 2 processes (gloo) launched by torchrun, against one process.

Every launch goes through ``python -m torch.distributed.run --standalone`` exactly as a user
would, running ``archlab train`` (through ``dist_worker.py`` when a test hook is needed).
Tolerance: fp32 on CPU; the two runs differ only in the order of float sums (each rank's half
batch, then the average), so losses agree to a relative 1e-5 (observed: ~1e-7) and checkpoint
round trips are exact.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import archlab
from archlab.config import make_config
from archlab.errors import CheckpointError, ConfigError
from archlab.train import distributed
from archlab.train.trainer import Run, train
from tests.conftest import SMALL
from tests.helpers import run_cli
from tests.train.dist_worker import flat_state

WORKER = Path(__file__).with_name("dist_worker.py")
RTOL = 1e-5
BASE = ["train.steps=8", "train.ckpt_every=4", "train.eval_every=4", "train.log_every=1", "train.threads=1"]
VARIANTS = {
    "baseline": [],
    "decode-branch": ["model.branch.enabled=true", "model.branch.n_branches=1"],
    "moe-branch": ["model.branch.enabled=true", "model.ffn=moe", "model.moe.n_experts=4", "model.moe.top_k=2",
                   "model.moe.expert_hidden=32", "model.moe.shared_expert=true"],
    "mhar": ["model.residual.kind=attnres", "model.residual.heads=2"],
}


def _overrides(data: Path, *extra: str) -> list[str]:
    return [*SMALL, f"data.path={data}", *BASE, *extra]


def _cfg(data: Path, *extra: str):
    return make_config("tiny", overrides=_overrides(data, *extra))


def _torchrun(data: Path, out: Path, *extra: str, env: dict[str, str] | None = None, worker: bool = False,
              check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 -m archlab.cli train ...`` (or the hooked worker)."""
    sets = [a for o in _overrides(data, *extra) for a in ("--set", o)]
    entry = [str(WORKER)] if worker else ["-m", "archlab.cli"]
    src = str(Path(archlab.__file__).resolve().parents[1])
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
                "PYTHONPATH": os.pathsep.join([src, str(WORKER.parents[2]), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.1", *entry, "train", "--preset", "tiny", *sets, "--out", str(out)]
    # the timeout only guards against a hang; nothing here asserts on time
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=180)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _losses(out: Path) -> list[tuple[int, float]]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["kind"] in ("train", "val")]


def _assert_same_curve(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [s for s, _ in got] == [s for s, _ in want]
    for (step, a), (_, b) in zip(got, want):
        assert a == pytest.approx(b, rel=RTOL), f"step {step}: {a} vs {b}"


@pytest.fixture(scope="module")
def reference(stdlib_data, tmp_path_factory):
    """One-process runs (the global batch on one process), by variant, built on demand."""
    done: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in done:
            out = tmp_path_factory.mktemp("ref") / variant
            train(_cfg(stdlib_data, *VARIANTS[variant]), out, show_progress=False)
            done[variant] = out
        return done[variant]
    return get


@pytest.mark.parametrize("variant,parallel,checkpointing", [
    ("baseline", "ddp", False), ("baseline", "fsdp", False), ("decode-branch", "fsdp", True),
    ("moe-branch", "ddp", False), ("moe-branch", "fsdp", True), ("mhar", "fsdp", False)])
def test_two_processes_match_one_process(stdlib_data, tmp_path, reference, variant, parallel, checkpointing):
    out = tmp_path / "run"
    _torchrun(stdlib_data, out, *VARIANTS[variant], f"train.parallel={parallel}",
              f"train.activation_checkpointing={str(checkpointing).lower()}")
    _assert_same_curve(_losses(out), _losses(reference(variant)))
    # the final checkpoint holds the gathered weights (what eval reads)
    state = json.loads((out / "ckpt" / "step_0000008" / "state.json").read_text())
    assert state["format"] == "dcp" and state["world_size"] == 2 and "model.safetensors" in state["files"]


def test_fsdp_checkpoint_loads_on_one_process_and_consolidates(stdlib_data, tmp_path, capsys):
    """Save on 2 processes (FSDP, sharded), load on 1: identical weights and optimizer state; the
    consolidated safetensors checkpoint holds the same and is what eval reads."""
    out, dump = tmp_path / "run", tmp_path / "dump"
    _torchrun(stdlib_data, out, "train.parallel=fsdp", env={"ARCHLAB_TEST_DUMP": str(dump)}, worker=True)
    truth = load_file(f"{dump}.final.safetensors")  # gathered from the live ranks, not from the files

    cfg = _cfg(stdlib_data, "train.parallel=fsdp")
    run = Run(cfg, out)
    assert run.try_resume() and run.step == 8
    loaded = flat_state(run.model, run.opt)
    assert loaded.keys() == truth.keys()
    for k in truth:
        assert torch.equal(loaded[k], truth[k]), k

    code, text, err = run_cli(capsys, "checkpoint", "consolidate", str(out), "--out", str(tmp_path / "single"))
    assert code == 0, err
    from archlab.io.checkpoint import load_model, read_state
    model, _, ck = load_model(tmp_path / "single")
    assert "format" not in read_state(ck)
    for name, v in model.state_dict().items():
        assert torch.equal(v, truth[f"model.{name}"]), name
    code, a, err = run_cli(capsys, "eval", "--ckpt", str(tmp_path / "single"), "--batches", "2", "--json")
    assert code == 0, err
    code, b, err = run_cli(capsys, "eval", "--ckpt", str(out), "--batches", "2", "--json")
    assert code == 0, err
    assert json.loads(a)["loss"] == json.loads(b)["loss"]
    # a sharded checkpoint from before the end has no gathered weights: eval says what to do
    code, _, err = run_cli(capsys, "eval", "--ckpt", str(out / "ckpt" / "step_0000004"))
    assert code == 1 and "archlab checkpoint consolidate" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "checkpoint", "consolidate", str(tmp_path / "single"), "--out", str(tmp_path / "x"))
    assert code == 1 and "nothing to consolidate" in err

    # ... and a one-process run resumes the consolidated checkpoint like its own
    run1 = Run(cfg, tmp_path / "single")
    assert run1.try_resume() and run1.step == 8
    for k, v in flat_state(run1.model, run1.opt).items():
        assert torch.equal(v, truth[k]), k


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_one_process_checkpoint_resumes_on_two_processes(stdlib_data, tmp_path, reference, parallel):
    """Save on 1 process (safetensors), resume on 2: the state the ranks hold after loading
    is the saved one, and the rest of the curve is the uninterrupted run's."""
    out, dump = tmp_path / "run", tmp_path / "dump"
    cfg = _cfg(stdlib_data)
    train(cfg, out, stop_after_steps=4, show_progress=False)
    run1 = Run(cfg, out)
    assert run1.try_resume() and run1.step == 4
    saved = flat_state(run1.model, run1.opt)
    proc = _torchrun(stdlib_data, out, f"train.parallel={parallel}", env={"ARCHLAB_TEST_DUMP": str(dump)}, worker=True)
    assert f"resuming from step 4 of {out}" in proc.stderr
    loaded = load_file(f"{dump}.resume.safetensors")
    assert loaded.keys() == saved.keys()
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
    _assert_same_curve(_losses(out), _losses(reference("baseline")))


def test_a_killed_rank_stops_every_rank_and_the_run_resumes(stdlib_data, tmp_path, reference):
    out = tmp_path / "run"
    proc = _torchrun(stdlib_data, out, "train.parallel=fsdp", env={"ARCHLAB_TEST_KILL": "1:6"}, worker=True,
                     check=False)
    assert proc.returncode != 0
    # rank 0 leaves with one line: its collective lost its peer, or torchrun stopped it
    lines = [line for line in proc.stderr.splitlines() if line.startswith("archlab: rank 0:")]
    assert len(lines) == 1 and ("lost contact with another rank" in lines[0] or "stopped by torchrun" in lines[0])
    assert (out / "ckpt" / "latest").read_text().strip() == "step_0000004"
    single = tmp_path / "single"
    shutil.copytree(out, single)
    proc = _torchrun(stdlib_data, out, "train.parallel=fsdp")
    assert f"resuming from step 4 of {out}" in proc.stderr
    _assert_same_curve(_losses(out), _losses(reference("baseline")))
    # the same sharded checkpoint, resumed by one process (no process group)
    train(_cfg(stdlib_data, "train.parallel=fsdp"), single, show_progress=False)
    _assert_same_curve(_losses(single), _losses(reference("baseline")))


def test_an_error_on_one_rank_is_one_line_and_every_rank_stops(stdlib_data, tmp_path):
    proc = _torchrun(stdlib_data, tmp_path / "run", "train.parallel=ddp", env={"ARCHLAB_TEST_FAIL": "1:2"},
                     worker=True, check=False)
    assert proc.returncode != 0
    assert "archlab: rank 1: test hook: rank 1 cannot go on at step 2" in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("archlab: rank 0:")]) == 1
    # no rank printed a traceback (torch prefixes a worker's with [rankN]; torchrun's own summary
    # of the failed workers follows, and is torchrun's)
    assert "[rank0]" not in proc.stderr and "[rank1]" not in proc.stderr


def test_a_hanging_rank_times_out_instead_of_hanging_the_run(stdlib_data, tmp_path):
    """A rank that stays alive but never joins the next collective: the others' collective
    fails after train.dist_timeout_s with one line, and torchrun stops the hanging rank."""
    proc = _torchrun(stdlib_data, tmp_path / "run", "train.parallel=ddp", "train.dist_timeout_s=5",
                     env={"ARCHLAB_TEST_HANG": "1:2"}, worker=True, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("archlab: rank 0:")]
    assert len(lines) == 1 and "lost contact with another rank" in lines[0], proc.stderr[-2000:]
    assert "[rank0]" not in proc.stderr


# ---- in one process: the parts that need no second process ---------------------------------------
def test_layout_options_do_not_change_the_run_identity():
    a = make_config("tiny")
    b = make_config("tiny", overrides=["train.parallel=fsdp", "train.activation_checkpointing=true"])
    assert a.hash() == b.hash()
    assert "parallel" not in a.to_dict()["train"] and b.to_dict()["train"]["parallel"] == "fsdp"
    with pytest.raises(ConfigError, match="train.parallel"):
        make_config("tiny", overrides=["train.parallel=zero3"])


def test_a_batch_that_does_not_divide_over_the_ranks_fails_before_any_process_waits(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    cfg = make_config("tiny", overrides=["train.batch_size=16"])
    with pytest.raises(ConfigError, match=r"train.batch_size=16 is the global batch and must divide evenly over the 3"):
        distributed.setup(cfg.train)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.setup(cfg.train) is None


def test_activation_checkpointing_on_one_process_changes_nothing(stdlib_data, tmp_path, reference):
    train(_cfg(stdlib_data, "train.activation_checkpointing=true"), tmp_path / "ac", show_progress=False)
    _assert_same_curve(_losses(tmp_path / "ac"), _losses(reference("baseline")))


def test_untrusted_dcp_metadata_is_refused(stdlib_data, tmp_path):
    """DCP stores .metadata with pickle: a file that would run code is refused, not run."""
    from archlab.io import dcp as dcp_io

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match="untrusted .metadata"):
        dcp_io.SafeReader(str(tmp_path / "dcp")).read_metadata()
    assert not (tmp_path / "pwned").exists()


def test_dcp_metadata_cannot_reach_a_function_through_an_allowed_module(tmp_path):
    """The allowed modules import ``os`` and other modules: a GLOBAL naming
    ``<allowed module> os.system`` (protocol 4 resolves dotted names) or one of their functions
    is refused, so the reader yields classes only."""
    from archlab.io import dcp as dcp_io

    allowed = "torch.distributed.checkpoint.filesystem"
    marker = tmp_path / "pwned"
    # GLOBAL module name, then the argument tuple, REDUCE, STOP: a hand-written protocol-4 call.
    evil = (b"\x80\x04c" + allowed.encode() + b"\nos.system\n" + pickle.dumps(("touch " + str(marker),),
            protocol=0)[:-1] + b"R.")
    not_a_class = b"\x80\x04c" + allowed.encode() + b"\ncast\n."
    for payload in (evil, not_a_class):
        (tmp_path / "dcp").mkdir(exist_ok=True)
        (tmp_path / "dcp" / ".metadata").write_bytes(payload)
        with pytest.raises(CheckpointError, match="untrusted .metadata"):
            dcp_io.SafeReader(str(tmp_path / "dcp")).read_metadata()
    assert not marker.exists()
