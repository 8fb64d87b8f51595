"""Who trains a run: claims in the results store, workers that die with their parent, and
concurrent compares on one suite directory. Real processes and real signals throughout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from archlab.lab.store.owner import STALE_AFTER_S, Owner, process_started
from archlab.lab.plan import build_plan
from archlab.lab.report import collect, overview
from archlab.lab.display import plan_table
from archlab.lab.runner import run_suite
from archlab.lab.store import DB_NAME, ResultStore, display_status
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import FakeTrainer, fake_costs, write_suite
from tests.lab.test_lab_store import result, start

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"}


def quiet() -> Console:
    return Console(file=open(os.devnull, "w"), width=200)


def gone(pid: int) -> bool:
    """No process has ``pid`` any more (a zombie counts as gone: it runs nothing, holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def wait_for(check, what: str, proc: subprocess.Popen | None = None, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited ({proc.returncode}): "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def hanging_compare(child: str, suite_file: Path, out: Path, marker: Path):
    """Python ``child`` run with (suite file, out, marker): a compare whose two ``--jobs`` workers
    hang after their step-20 checkpoints, each writing "RUN PID" to ``marker``. Yields (the
    process, {run: worker pid}) once both hang; kills whatever a failure left behind."""
    proc = subprocess.Popen([sys.executable, "-c", child, str(suite_file), str(out), str(marker)],
                            env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        wait_for(lambda: marker.exists() and len(marker.read_text().splitlines()) == 2, "two hanging workers", proc)
        hanging = dict(line.split() for line in marker.read_text().splitlines())
        workers += [int(pid) for pid in hanging.values()]
        yield proc, hanging
    finally:
        for pid in [proc.pid, *workers]:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_process_identity() -> None:
    me = Owner.current()
    assert me.pid == os.getpid() and me.started == process_started(os.getpid()) != ""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_started(child.pid) not in (None, me.started)
    finally:
        child.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while process_started(child.pid) is not None:  # a zombie until reaped: already gone
        assert time.monotonic() < deadline
        time.sleep(0.02)
    child.wait()
    assert process_started(child.pid) is None


# Claims run "a" and says so, then lives until killed.
CLAIMER = """
import sys, time
from pathlib import Path
from archlab.lab.store.owner import Owner
from archlab.lab.store import ResultStore
from tests.lab.test_lab_store import start
store = ResultStore(Path(sys.argv[1]))
print(store.claim_run(start("a"), Owner.current()).state, flush=True)
time.sleep(600)
"""


def test_a_claim_holds_while_its_process_lives_and_is_taken_over_after(tmp_path: Path) -> None:
    db = tmp_path / "r.sqlite"
    me = Owner.current()
    holder = subprocess.Popen([sys.executable, "-c", CLAIMER, str(db)], env=ENV, cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
        with ResultStore(db) as store:
            got = store.claim_run(start("a"), me)
            assert got.state == "busy" and got.holder is not None and got.holder.pid == holder.pid
            row = store.get("a")
            assert display_status(row, store.live_claims()) == "running" and row.attempts == 1
            store.release("a", me)  # not ours: left alone
            assert store.claims()["a"].owner.pid == holder.pid
            assert store.claim_run(start("b"), me).state == "claimed"
            assert store.runs_on_host() == 2  # the context a run's tokens/s is measured in
            store.release("b", me)
            assert store.runs_on_host() == 1
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with ResultStore(db) as store:
        row = store.get("a")
        assert display_status(row, store.live_claims()) == "interrupted"
        got = store.claim_run(start("a"), me)  # the dead pid's claim is taken over
        assert got.state == "claimed" and got.taken_from is not None and got.taken_from.pid == holder.pid
        assert store.get("a").attempts == 2 and store.claims()["a"].owner == me
        assert display_status(store.get("a"), store.live_claims()) == "running"

        # A live pid whose process started at another time is a reused pid: the claim is gone.
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            raw = sqlite3.connect(db)
            raw.execute("UPDATE claims SET pid = ?, started = 'another start' WHERE key = 'a'", (other.pid,))
            raw.commit()
            raw.close()
            assert store.claim_run(start("a"), me).taken_from.pid == other.pid
        finally:
            other.send_signal(signal.SIGKILL)
            other.wait()

        # Another host's claim cannot be checked by pid: live while its heartbeat is fresh.
        raw = sqlite3.connect(db)
        raw.execute("UPDATE claims SET host = 'elsewhere', heartbeat_at = ? WHERE key = 'a'", (time.time(),))
        raw.commit()
        assert store.claim_run(start("a"), me).state == "busy"
        raw.execute("UPDATE claims SET heartbeat_at = ? WHERE key = 'a'", (time.time() - STALE_AFTER_S - 1,))
        raw.commit()
        raw.close()
        assert store.claim_run(start("a"), me).taken_from.host == "elsewhere"

        # Recording the result drops the claim in the same transaction; a finished run is done.
        store.finish_run("a", result(), final_val_loss=2.0, final_val_bpb=1.0, runs_at_once=1)
        assert store.claims() == {} and store.claim_run(start("a"), me).state == "done"


# A compare with two workers whose runs all hang after their step-20 checkpoints.
PARALLEL_CHILD = """
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
              console=Console(width=150), jobs=2)
"""


def test_kill_9_of_a_parallel_compare_takes_its_workers_and_leaves_runs_interrupted(tmp_path: Path) -> None:
    suite_file, out, marker = write_suite(tmp_path), tmp_path / "out", tmp_path / "hanging"
    with hanging_compare(PARALLEL_CHILD, suite_file, out, marker) as (proc, hanging):
        workers = [int(pid) for pid in hanging.values()]
        assert len(set(workers)) == 2 and proc.pid not in workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: all(gone(pid) for pid in workers), "the orphaned workers to die", timeout=5.0)

    # Nothing trains the two runs now: the report and the plan say interrupted, not running.
    plan = build_plan(load_suite(suite_file), out, costs_fn=fake_costs)
    with ResultStore(out / DB_NAME, create=False) as store:
        rows = {r.run_id: r for r in store.runs()}
        assert sorted(r.status for r in rows.values()) == ["running", "running"]
        assert set(rows) == set(hanging)
        facts = overview(collect(store))
        table, summary = plan_table(plan, list(plan.runs), rows, store.live_claims())
    assert "Runs: 0 of 7 finished, 2 interrupted" in facts[3] and "running" not in facts[3]
    assert "2 interrupted" in summary and "being trained" not in summary
    console = Console(record=True, width=250, file=open(os.devnull, "w"))
    console.print(table)
    shown = console.export_text()
    assert shown.count("interrupted") == 2 and shown.count("pending") == 5

    # A new compare takes the dead workers' claims over and resumes from their checkpoints.
    fake = FakeTrainer()
    with ResultStore(out / DB_NAME) as store:
        outcome = run_suite(plan, store, list(plan.runs), train_fn=fake, console=quiet())
        assert outcome.finished == 7 and outcome.busy == ()
        assert {name: step for name, step in fake.calls if name in hanging} == {name: 20 for name in hanging}
        assert {r.run_id: r.attempts for r in store.runs() if r.run_id in hanging} == {n: 2 for n in hanging}
        assert store.claims() == {}


# What compare does on a shared suite directory, less the report (seconds of plotting).
COMPARE_CHILD = """
import sys
from pathlib import Path
from rich.console import Console
from archlab.lab.plan import build_plan
from archlab.lab.runner import run_suite, suite_lock
from archlab.lab.store import ResultStore, DB_NAME
from archlab.lab.suite import load_suite
from tests.lab.lab_fakes import FakeTrainer, fake_costs
suite_file, out, log, gate = map(Path, sys.argv[1:5])
plan = build_plan(load_suite(suite_file), out, costs_fn=fake_costs)
fake = FakeTrainer(log=log, hold_until=gate, step_delay=0.004)
with suite_lock(plan.out_dir), ResultStore(out / DB_NAME) as store:
    run_suite(plan, store, list(plan.runs), train_fn=fake, console=Console(width=150))
"""


def test_two_compares_on_one_suite_directory_never_train_a_run_twice(tmp_path: Path) -> None:
    suite_file, out, log, gate = write_suite(tmp_path), tmp_path / "out", tmp_path / "calls.jsonl", tmp_path / "go"

    def trainers() -> dict[int, list[str]]:
        by_pid: dict[int, list[str]] = {}
        for line in log.read_text().splitlines() if log.exists() else []:
            name, step, pid = json.loads(line)
            assert step == 0
            by_pid.setdefault(pid, []).append(name)
        return by_pid

    def compare() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", COMPARE_CHILD, str(suite_file), str(out), str(log),
                                 str(gate)], env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)

    # Each compare's first run waits at the gate until the other compare trains a run too, so
    # they overlap for certain; past the gate they race for the remaining runs.
    procs = [compare(), compare()]
    try:
        def both_started() -> bool:  # a compare that dies says why, rather than a timeout later
            for p in procs:
                if p.poll() is not None:
                    raise AssertionError(f"a compare exited ({p.returncode}): {p.stderr.read() if p.stderr else ''}")
            return len(trainers()) == 2

        wait_for(both_started, "both compares to start a run")
        assert sorted(trainers()) == sorted(p.pid for p in procs)
        gate.touch()
        for p in procs:
            assert p.wait(timeout=120) == 0, p.stderr.read() if p.stderr else ""
    finally:
        gate.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    names = [name for runs in trainers().values() for name in runs]
    with ResultStore(out / DB_NAME, create=False) as store:
        rows = store.runs()
        assert store.claims() == {}
    assert len(rows) == 7 and all(r.status == "finished" and r.attempts == 1 for r in rows)
    assert sorted(names) == sorted(r.run_id for r in rows)  # every run trained once, by one process
