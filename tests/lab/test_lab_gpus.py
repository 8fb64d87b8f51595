"""``compare --gpus``: which GPUs each run gets (never more runs on a GPU than its slots), the
worker processes pinned by CUDA_VISIBLE_DEVICES, the torchrun command of a multi-GPU run, and
claims as leases that another worker takes over. All on CPU: the device list is injected."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from archlab.config import make_config
from archlab.errors import ConfigError, OutOfMemory
from archlab.lab.store.owner import lease_s
from archlab.lab.cli import gpu_plan
from archlab.lab.gpus import GpuPlan, GpuSlots, child_visible_devices, launch_command, parse_gpus
from archlab.lab.plan import build_plan
from archlab.lab.runner import run_suite
from archlab.lab.store import DB_NAME, ResultStore
from archlab.lab.suite import load_suite
from archlab.lab.worker import LAUNCH_CONFIG, torchrun_train
from tests.lab.lab_fakes import SUITE_YAML, FakeTrainer, fake_costs, write_suite

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"}

# Four runs: two baseline seeds, one seed of each variant.
SMALL_SUITE = SUITE_YAML.replace("seeds: {baseline: [0, 1, 2], variants: [0, 1]}",
                                 "seeds: {baseline: [0, 1], variants: [0]}")


def quiet() -> Console:
    return Console(file=open(os.devnull, "w"), width=200)


# ---- parsing and placement -------------------------------------------------------------------
def test_parse_gpus() -> None:
    assert parse_gpus("all", 4) == (0, 1, 2, 3)
    assert parse_gpus("2, 0", 4) == (2, 0)
    for spec, visible, msg in [("0,4", 4, "GPU 4 does not exist; this process sees 4"),
                               ("all", 0, "no CUDA device is visible"),
                               ("0,x", 2, "expected 'all' or GPU indices"),
                               ("-1", 2, "expected 'all' or GPU indices")]:
        with pytest.raises(ConfigError, match=msg):
            parse_gpus(spec, visible)
    with pytest.raises(ConfigError, match="names a GPU twice"):
        GpuPlan((0, 0))
    with pytest.raises(ConfigError, match="--gpus-per-run 3 needs at least that many GPUs"):
        GpuPlan((0, 1), gpus_per_run=3)
    assert GpuPlan((0, 1, 2, 3), runs_per_gpu=2, gpus_per_run=2).concurrency == 4
    assert GpuPlan((0, 1, 2), runs_per_gpu=1, gpus_per_run=2).concurrency == 1


def test_child_visible_devices_maps_through_the_parents_own_list() -> None:
    assert child_visible_devices((0, 1), {}) == "0,1"
    assert child_visible_devices((1,), {"CUDA_VISIBLE_DEVICES": "4,6"}) == "6"
    assert child_visible_devices((0, 1), {"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}) == "GPU-aa,GPU-bb"
    with pytest.raises(ConfigError, match="not among CUDA_VISIBLE_DEVICES=4"):
        child_visible_devices((1,), {"CUDA_VISIBLE_DEVICES": "4"})


def test_slots_spread_runs_first_and_never_oversubscribe() -> None:
    slots = GpuSlots(GpuPlan((3, 1, 2), runs_per_gpu=2))
    # One run per GPU before any GPU gets a second, in the order --gpus names them.
    assert [slots.take() for _ in range(3)] == [(3,), (1,), (2,)]
    assert [slots.take() for _ in range(3)] == [(3,), (1,), (2,)]
    assert slots.take() is None
    slots.give((1,))
    assert slots.take() == (1,) and slots.take() is None
    with pytest.raises(RuntimeError, match="given back more often"):
        GpuSlots(GpuPlan((0,))).give((0,))

    # Random interleavings of runs starting and ending, with runs on 1 to 3 GPUs each.
    rng = random.Random(0)
    for _ in range(200):
        gpus = tuple(rng.sample(range(8), rng.randint(1, 5)))
        plan = GpuPlan(gpus, runs_per_gpu=rng.randint(1, 3), gpus_per_run=rng.randint(1, len(gpus)))
        slots, running = GpuSlots(plan), []
        for _ in range(60):
            if running and rng.random() < 0.4:
                slots.give(running.pop(rng.randrange(len(running))))
                continue
            got = slots.take()
            use = {g: sum(g in r for r in running) for g in gpus}
            if got is None:  # refused only when fewer GPUs than a run needs have a free slot
                assert sum(use[g] < plan.runs_per_gpu for g in gpus) < plan.gpus_per_run
                continue
            assert len(set(got)) == len(got) == plan.gpus_per_run and set(got) <= set(gpus)
            running.append(got)
            for g in gpus:
                assert sum(g in r for r in running) <= plan.runs_per_gpu
            assert len(running) <= plan.concurrency


def namespace(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"gpus": None, "runs_per_gpu": None, "gpus_per_run": None, "jobs": 1, **kw})


def test_compare_options_are_checked_against_the_devices_and_the_runs(tmp_path: Path) -> None:
    plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "out", costs_fn=fake_costs)
    runs = list(plan.runs)
    assert gpu_plan(namespace(), runs, gpu_count=0) is None  # no --gpus: compare as it always was
    assert gpu_plan(namespace(gpus="all", runs_per_gpu=3), runs, gpu_count=2) == GpuPlan((0, 1), 3, 1)
    for kw, msg in [(dict(runs_per_gpu=2), "need --gpus"),
                    (dict(gpus="0", jobs=2), "--jobs and --gpus do not combine"),
                    (dict(gpus="0,1", gpus_per_run=3), "--gpus-per-run 3 needs at least that many GPUs"),
                    (dict(gpus="2"), "GPU 2 does not exist"),
                    # N copies of a run that is not data/model parallel would be N trainers of one run
                    (dict(gpus="0,1", gpus_per_run=2), "needs train.parallel ddp or fsdp in every run")]:
        with pytest.raises(ConfigError, match=msg):
            gpu_plan(namespace(**kw), runs, gpu_count=2)
    pinned = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "out", ["train.device=cuda:1"],
                        costs_fn=fake_costs)
    with pytest.raises(ConfigError, match="train.device is cuda:1; set train.device to cuda or auto"):
        gpu_plan(namespace(gpus="0"), list(pinned.runs), gpu_count=2)


# ---- the worker processes --------------------------------------------------------------------
class GpuRecorder(FakeTrainer):
    """The fake trainer, also appending [run, pid, CUDA_VISIBLE_DEVICES, start, end] to ``record``
    (the interval is inside the one the run's GPU slot was held: taken before the worker started,
    given back after it exited)."""

    def __init__(self, record: Path, **kw: Any) -> None:
        super().__init__(**kw)
        self.record = record

    def __call__(self, cfg, out_dir, **kw):  # type: ignore[no-untyped-def]
        t0 = time.time()
        result = super().__call__(cfg, out_dir, **kw)
        with open(self.record, "a") as f:
            f.write(json.dumps([Path(out_dir).name, os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                                t0, time.time()]) + "\n")
        return result


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(t0, 1) for t0, _ in intervals] + [(t1, -1) for _, t1 in intervals])
    now = peak = 0
    for _, delta in events:  # at equal times an end sorts before a start
        now += delta
        peak = max(peak, now)
    return peak


def test_runs_train_in_worker_processes_pinned_to_their_gpus(tmp_path: Path) -> None:
    suite_file, out, record = write_suite(tmp_path, SMALL_SUITE), tmp_path / "out", tmp_path / "record.jsonl"
    plan = build_plan(load_suite(suite_file), out, costs_fn=fake_costs)
    with ResultStore(out / DB_NAME) as store:
        outcome = run_suite(plan, store, list(plan.runs), console=quiet(),
                            train_fn=GpuRecorder(record, step_delay=0.01), gpus=GpuPlan((1, 0), runs_per_gpu=1))
        rows = store.runs()
        assert store.claims() == {}
    assert outcome.finished == 4 and outcome.busy == ()
    assert len(rows) == 4 and all(r.status == "finished" and r.attempts == 1 for r in rows)
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted(name for name, *_ in lines) == sorted(r.run_id for r in rows)  # each once
    assert all(pid != os.getpid() for _, pid, *_ in lines) and len({pid for _, pid, *_ in lines}) == 4
    assert {cvd for _, _, cvd, *_ in lines} <= {"0", "1"}
    for gpu in ("0", "1"):
        assert most_at_once([(t0, t1) for _, _, cvd, t0, t1 in lines if cvd == gpu]) <= 1
    assert not (out / ".workers").exists()  # job files live in a private temporary directory

    # Resumable as ever: everything done, nothing trained again.
    with ResultStore(out / DB_NAME) as store:
        again = run_suite(plan, store, list(plan.runs), console=quiet(), train_fn=GpuRecorder(record),
                          gpus=GpuPlan((0,)))
    assert again.skipped == 4 and again.finished == 0 and len(record.read_text().splitlines()) == 4


def test_a_worker_error_reaches_compare_and_leaves_the_run_resumable(tmp_path: Path) -> None:
    suite_file, out = write_suite(tmp_path, SMALL_SUITE), tmp_path / "out"
    plan = build_plan(load_suite(suite_file), out, costs_fn=fake_costs)
    with ResultStore(out / DB_NAME) as store:
        # A diverged run is a result; the suite goes on.
        outcome = run_suite(plan, store, list(plan.runs), console=quiet(), gpus=GpuPlan((0,)),
                            train_fn=FakeTrainer(diverge=("lower-init",)))
        assert outcome.finished == 3 and outcome.diverged == 1
    # Any other failure (here: the fake cannot write its log) is raised in compare, the run resumable.
    with ResultStore(tmp_path / "other.sqlite") as store:
        with pytest.raises(FileNotFoundError):
            run_suite(plan, store, list(plan.runs)[:1], console=quiet(), gpus=GpuPlan((0,)),
                      train_fn=FakeTrainer(log=tmp_path / "no-such-dir" / "log"))
        assert store.claims() == {} and [r.status for r in store.runs()] == ["running"]


class OutOfMemoryError(RuntimeError):
    """Stands in for torch.OutOfMemoryError (matched by name, as archlab.errors does)."""


@dataclass(frozen=True)
class OutOfMemoryTrainer:
    def __call__(self, cfg: Any, out: Path, **kwargs: Any) -> Any:
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB.")


def test_a_worker_out_of_memory_is_one_line_and_the_run_stays_resumable(tmp_path: Path) -> None:
    """Call 1 of the seventh session: 14 runs on one H200, one ran out of memory, and compare ended
    in a traceback. It is a resource limit the user sets, so it is one line saying what to change."""
    plan = build_plan(load_suite(write_suite(tmp_path, SMALL_SUITE)), tmp_path / "out", costs_fn=fake_costs)
    with ResultStore(tmp_path / "out" / DB_NAME) as store:
        with pytest.raises(OutOfMemory, match=r"^llama seed 0 ran out of GPU memory .* fewer --jobs") as e:
            run_suite(plan, store, list(plan.runs)[:1], console=quiet(), gpus=GpuPlan((0,)),
                      train_fn=OutOfMemoryTrainer())
        assert "\n" not in str(e.value)
        assert store.claims() == {} and [r.status for r in store.runs()] == ["running"]


class OutOfMemoryOnceTrainer(FakeTrainer):
    """The fake trainer, except that the first attempt at a run of ``label`` runs out of memory
    after its checkpoint at step 10 (``marker`` records that it did, across worker processes)."""

    def __init__(self, label: str, marker: Path, log: Path) -> None:
        super().__init__(log=log)
        self.label, self.marker = label, marker

    def __call__(self, cfg: Any, out: Path, **kwargs: Any) -> Any:
        if not Path(out).name.startswith(f"{self.label}-") or self.marker.exists():
            return super().__call__(cfg, out, **kwargs)
        self.marker.touch()
        super().__call__(cfg, out, **{**kwargs, "stop_after_steps": 10})
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB.")


def test_a_pool_worker_out_of_memory_lowers_the_limit_and_the_run_resumes(tmp_path: Path) -> None:
    """16 runs on one H100 (2026-12-05): the iso-FLOP branch ran out of memory and the whole
    compare ended. Now the pool runs one fewer at once and the run resumes from its checkpoint."""
    plan = build_plan(load_suite(write_suite(tmp_path, SMALL_SUITE)), tmp_path / "out", costs_fn=fake_costs)
    log, marker = tmp_path / "log", tmp_path / "oom-once"
    console = Console(file=open(os.devnull, "w"), width=300, record=True)
    with ResultStore(tmp_path / "out" / DB_NAME) as store:
        outcome = run_suite(plan, store, list(plan.runs), console=console, jobs=2,
                            train_fn=OutOfMemoryOnceTrainer("same", marker, log))
        assert outcome.finished == 4 and marker.exists()
        assert all(r.status == "finished" for r in store.runs()) and store.claims() == {}
    said = " ".join(console.export_text().split())
    assert re.search(r"same seed 0 ran out of GPU memory beside [01] other run\(s\): from now on at most 1 at "
                     r"once; it resumes from its last checkpoint", said), said
    starts = [(name, step) for name, step, _pid in map(json.loads, log.read_text().splitlines())
              if name.startswith("same-")]
    assert [step for _name, step in starts] == [0, 10]  # the second attempt resumed at the checkpoint


def test_out_of_memory_of_a_run_alone_ends_compare_in_one_line(tmp_path: Path) -> None:
    """Every run runs out of memory: the pool goes down to one run at a time, and a run that runs
    out of memory alone ends the compare with advice about the run, not about --jobs."""
    plan = build_plan(load_suite(write_suite(tmp_path, SMALL_SUITE)), tmp_path / "out", costs_fn=fake_costs)
    with ResultStore(tmp_path / "out" / DB_NAME) as store:
        with pytest.raises(OutOfMemory, match=r"^\S+ seed 0 ran out of GPU memory with no other run beside "
                                              r"it; .* train.grad_accum") as e:
            run_suite(plan, store, list(plan.runs)[:2], console=quiet(), jobs=2, train_fn=OutOfMemoryTrainer())
        assert "\n" not in str(e.value) and store.claims() == {}


def test_the_torchrun_command_and_config_of_a_multi_gpu_run(tmp_path: Path) -> None:
    cmd = launch_command(tmp_path / "run" / LAUNCH_CONFIG, tmp_path / "run", 4, python="/py")
    assert cmd == ["/py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                   "-m", "archlab.cli", "train", "--config", str(tmp_path / "run" / LAUNCH_CONFIG),
                   "--out", str(tmp_path / "run"), "--resume", "auto"]
    # archlab train reads back exactly the run's config (over its default preset).
    plan = build_plan(load_suite(write_suite(tmp_path)), tmp_path / "out", costs_fn=fake_costs)
    run = list(plan.runs)[-1]
    from archlab.config import dump_yaml

    (tmp_path / LAUNCH_CONFIG).write_text(dump_yaml(run.config))
    assert make_config("tiny", [tmp_path / LAUNCH_CONFIG], []).hash() == run.config.hash() == run.config_hash


def test_a_run_under_torchrun_trains_and_is_read_back(stdlib_data: Path, tmp_path: Path) -> None:
    """The real command on CPU with one process: torchrun, archlab train, the result read back from
    metrics.jsonl. (On N GPUs the same command runs with --nproc-per-node N.)"""
    cfg = make_config("tiny", None, [f"data.path={stdlib_data}", "model.vocab_size=512", "model.d_model=32",
                                     "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                                     "train.batch_size=4", "train.seq_len=32", "train.warmup_steps=2",
                                     "train.eval_batches=2", "train.steps=6", "train.eval_every=3",
                                     "train.log_every=2", "train.ckpt_every=3", "train.device=cpu"])
    run_dir = tmp_path / "run"
    res = torchrun_train(cfg, run_dir, 1)
    assert res.steps == 6 and res.tokens == 6 * cfg.train.tokens_per_step
    assert [p["step"] for p in res.val_curve] == [3, 6] and res.final_val_loss == res.val_curve[-1]["loss"]
    assert res.tokens_per_s > 0 and res.params > 0 and (run_dir / "ckpt" / "latest").is_file()
    # Not a run's first attempt: torchrun resumes it like any lab run (nothing left to train).
    again = torchrun_train(cfg, run_dir, 1)
    assert again.steps == 6 and "resuming from step 6" in (run_dir / "torchrun.log").read_text()


def _pids_running(needle: str) -> list[int]:
    """Live (not zombie) processes whose command line contains ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the ranks through /proc")
def test_kill_9_of_the_worker_takes_torchruns_ranks_with_it(stdlib_data: Path, tmp_path: Path) -> None:
    """A run on several GPUs trains in torchrun's ranks, grandchildren of the worker. The worker
    (and torchrun's agent, set to die with it) going down to SIGKILL must not leave a rank
    training into the run directory (the sixth session's known limit)."""
    run_dir = tmp_path / "run"
    script = tmp_path / "worker.py"
    script.write_text(f"""
from pathlib import Path
from archlab.config import make_config
from archlab.lab.worker import torchrun_train
cfg = make_config("tiny", None, ["data.path={stdlib_data}", "model.vocab_size=512", "model.d_model=32",
                                 "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                                 "train.batch_size=4", "train.seq_len=32", "train.steps=1000000",
                                 "train.eval_every=1000000", "train.log_every=1", "train.ckpt_every=1000000",
                                 "train.device=cpu"])
torchrun_train(cfg, Path({str(run_dir)!r}), 1)
""")
    worker = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").is_file() or not _pids_running(f"--out {run_dir}"):
            assert worker.poll() is None and time.monotonic() < deadline, "the rank never started training"
            time.sleep(0.2)
        ranks = [p for p in _pids_running(f"--out {run_dir}") if p != worker.pid]
        assert ranks  # torchrun's agent and its rank
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        deadline = time.monotonic() + 15
        while _pids_running(f"--out {run_dir}") and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _pids_running(f"--out {run_dir}")
    finally:
        for pid in _pids_running(f"--out {run_dir}"):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes still training into the run directory: {left}"


# ---- claims as leases ------------------------------------------------------------------------
def test_lease_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ARCHLAB_CLAIM_LEASE_S", raising=False)
    monkeypatch.delenv("ARCHLAB_CLAIM_HEARTBEAT_S", raising=False)
    assert lease_s() == 300.0
    monkeypatch.setenv("ARCHLAB_CLAIM_LEASE_S", "2")
    monkeypatch.setenv("ARCHLAB_CLAIM_HEARTBEAT_S", "0.5")
    assert lease_s() == 2.0
    monkeypatch.setenv("ARCHLAB_CLAIM_HEARTBEAT_S", "1.5")
    with pytest.raises(ConfigError, match="shorter than two heartbeats"):
        lease_s()
    monkeypatch.setenv("ARCHLAB_CLAIM_LEASE_S", "soon")
    with pytest.raises(ConfigError, match="ARCHLAB_CLAIM_LEASE_S='soon': expected a positive number"):
        lease_s()


# A compare whose runs all hang after their step-20 checkpoint (a machine about to die).
HANGING_COMPARE = """
import sys
from pathlib import Path
from rich.console import Console
from archlab.lab.plan import build_plan
from archlab.lab.runner import run_suite
from archlab.lab.store import ResultStore, DB_NAME
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import FakeTrainer, fake_costs
suite_file, out, marker = map(Path, sys.argv[1:4])
plan = build_plan(load_suite(suite_file), out, costs_fn=fake_costs)
with ResultStore(out / DB_NAME) as store:
    run_suite(plan, store, list(plan.runs), train_fn=FakeTrainer(hang_at=("", 20), hang_marker=marker),
              console=Console(width=150))
"""


def test_a_dead_machines_claim_is_taken_over_once_its_lease_expires(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    suite_file, out, marker = write_suite(tmp_path, SMALL_SUITE), tmp_path / "out", tmp_path / "hanging"
    proc = subprocess.Popen([sys.executable, "-c", HANGING_COMPARE, str(suite_file), str(out), str(marker)],
                            env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "timed out waiting for the first run to hang"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    hung = marker.read_text().split()[0]
    # Seen from this host, the claim of a process on another machine: its pid means nothing here,
    # and its last heartbeat was just now.
    raw = sqlite3.connect(out / DB_NAME)
    raw.execute("UPDATE claims SET host = 'elsewhere', heartbeat_at = ? WHERE key = ?", (time.time(), hung))
    raw.commit()
    raw.close()

    monkeypatch.setenv("ARCHLAB_CLAIM_LEASE_S", "2")
    monkeypatch.setenv("ARCHLAB_CLAIM_HEARTBEAT_S", "0.5")
    plan = build_plan(load_suite(suite_file), out, costs_fn=fake_costs)
    fake = FakeTrainer()
    with ResultStore(out / DB_NAME) as store:
        first = run_suite(plan, store, list(plan.runs), train_fn=fake, console=quiet())
        if first.busy:  # the lease was still running: the run is left to its holder
            assert first.busy == (hung,) and first.finished == 3 and hung not in dict(fake.calls)
            while time.time() - store.claims()[hung].heartbeat_at < 2.0:
                time.sleep(0.1)  # the machine stays silent: the lease runs out
            second = run_suite(plan, store, list(plan.runs), train_fn=fake, console=quiet())
            assert second.finished == 1 and second.busy == ()
        rows = {r.run_id: r for r in store.runs()}
        assert all(r.status == "finished" for r in rows.values()) and store.claims() == {}
    assert dict(fake.calls)[hung] == 20  # resumed from the dead machine's last checkpoint
    assert rows[hung].attempts == 2 and sorted(name for name, _ in fake.calls) == sorted(rows)


MOUNTINFO = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
40 22 0:50 / /shared rw,relatime shared:20 - nfs4 server:/export rw,vers=4.2
41 40 259:3 / /shared/local\\040disk rw,relatime shared:21 - xfs /dev/nvme1n1 rw
"""


def test_a_suite_directory_on_a_network_filesystem_is_recognized() -> None:
    from archlab.lab.store.owner import network_filesystem

    assert network_filesystem(Path("/shared/suite/x"), MOUNTINFO) == "nfs4"
    assert network_filesystem(Path("/shared"), MOUNTINFO) == "nfs4"
    assert network_filesystem(Path("/shared/local disk/suite"), MOUNTINFO) is None  # a local mount inside
    assert network_filesystem(Path("/sharedx/suite"), MOUNTINFO) is None
    assert network_filesystem(Path("/home/me"), MOUNTINFO) is None


# A compare with --gpus 0 on a shared suite directory (what run_compare does, less the report).
GPU_COMPARE = """
import sys
from pathlib import Path
from rich.console import Console
from archlab.lab.gpus import GpuPlan
from archlab.lab.plan import build_plan
from archlab.lab.runner import run_suite, suite_lock
from archlab.lab.store import ResultStore, DB_NAME
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import FakeTrainer, fake_costs
suite_file, out, log, gate = map(Path, sys.argv[1:5])
plan = build_plan(load_suite(suite_file), out, costs_fn=fake_costs)
fake = FakeTrainer(log=log, hold_until=gate, step_delay=0.004)
with suite_lock(plan.out_dir), ResultStore(out / DB_NAME) as store:
    run_suite(plan, store, list(plan.runs), train_fn=fake, console=Console(width=150), gpus=GpuPlan((0,)))
"""


def test_two_gpu_compares_on_one_suite_directory_split_it(tmp_path: Path) -> None:
    suite_file, out = write_suite(tmp_path, SMALL_SUITE), tmp_path / "out"
    log, gate = tmp_path / "calls.jsonl", tmp_path / "go"

    def trained() -> list[tuple[str, int]]:
        return [(name, pid) for name, _step, pid in
                (json.loads(line) for line in (log.read_text().splitlines() if log.exists() else []))]

    procs = [subprocess.Popen([sys.executable, "-c", GPU_COMPARE, str(suite_file), str(out), str(log), str(gate)],
                              env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        # Each compare trains one run at a time, held at the gate: two workers logged at once are
        # one from each compare, so the compares overlap for certain.
        deadline = time.monotonic() + 120
        while len(trained()) < 2:
            for p in procs:
                assert p.poll() is None, p.stderr.read() if p.stderr else ""
            assert time.monotonic() < deadline, "timed out waiting for both compares to train a run"
            time.sleep(0.05)
        gate.touch()
        for p in procs:
            assert p.wait(timeout=180) == 0, p.stderr.read() if p.stderr else ""
    finally:
        gate.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    with ResultStore(out / DB_NAME, create=False) as store:
        rows = store.runs()
        assert store.claims() == {}
    assert len(rows) == 4 and all(r.status == "finished" and r.attempts == 1 for r in rows)
    assert sorted(name for name, _ in trained()) == sorted(r.run_id for r in rows)  # each once


def test_compare_cli_parses_the_gpu_options_and_dry_run_shows_the_placement(tmp_path: Path) -> None:
    from archlab.cli import build_parser
    from archlab.lab.cli import run_compare

    suite_file = write_suite(tmp_path)
    args = build_parser().parse_args(["compare", str(suite_file), "--out", str(tmp_path / "out"), "--gpus", "all",
                                      "--runs-per-gpu", "2", "--dry-run"])
    console = Console(record=True, width=200, file=open(os.devnull, "w"))
    assert run_compare(args, costs_fn=fake_costs, console=console, gpu_count=4) == 0
    assert "placing runs on GPU 0,1,2,3: 2 per GPU, 1 per run, up to 8 at once" in console.export_text()
    assert not (tmp_path / "out" / DB_NAME).exists()
    bad = build_parser().parse_args(["compare", str(suite_file), "--gpus", "0", "--jobs", "2", "--dry-run"])
    with pytest.raises(ConfigError, match="--jobs and --gpus do not combine"):
        run_compare(bad, costs_fn=fake_costs, console=console, gpu_count=1)
