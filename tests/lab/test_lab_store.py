"""The results store: schema, immutability of finished rows, and writers killed mid-write."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from archlab.errors import ArchlabError
from archlab.lab.store import COST_KEYS, SCHEMA_VERSION, ResultStore, RunStart
from tests.lab.lab_fakes import FakeResult

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"}


def start(run_id: str) -> RunStart:
    return RunStart(run_id=run_id, suite="s", label="llama", role="baseline", init_seed=0, data_seed=0,
                    config={"model": {}}, config_hash="abc", code_revision="rev", planned_tokens=100,
                    planned_steps=10, costs={k: 1.0 for k in COST_KEYS}, cost_context=128)


def result(loss: float = 3.0, points: int = 3) -> FakeResult:
    curve = [{"step": i, "tokens": i * 10, "loss": loss + 1.0 / (i + 1), "bpb": 1.0} for i in range(points)]
    return FakeResult(final_val_loss=loss, final_val_bpb=1.0, val_curve=curve, train_curve=curve,
                      tokens=100, steps=10, tokens_per_s=50.0, wall_s=2.0, device="cpu", params=7)


def test_schema_wal_and_roundtrip(tmp_path: Path) -> None:
    db = tmp_path / "r.sqlite"
    with ResultStore(db) as store:
        assert store.start_run(start("a"))
        store.finish_run("a", result(), final_val_loss=2.5, final_val_bpb=1.1)
        store.set_meta("plan", {"x": [1, 2]})
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    raw.close()
    with ResultStore(db, create=False) as store:
        row = store.get("a")
        assert row is not None and row.status == "finished" and row.final_val_loss == 2.5
        assert row.val_curve[1]["loss"] == pytest.approx(3.5) and row.device == "cpu"
        assert row.costs["train_flops_per_token"] == 1.0 and store.get_meta("plan") == {"x": [1, 2]}


def test_finished_rows_are_never_overwritten(tmp_path: Path) -> None:
    with ResultStore(tmp_path / "r.sqlite") as store:
        store.start_run(start("a"))
        store.finish_run("a", result(), final_val_loss=2.5, final_val_bpb=1.1)
        assert store.start_run(start("a")) is False  # a resumed suite skips it
        with pytest.raises(RuntimeError):
            store.finish_run("a", result(), final_val_loss=9.9, final_val_bpb=9.9)
        with pytest.raises(RuntimeError):
            store.mark_diverged("a", "boom")
        assert store.get("a").final_val_loss == 2.5
    # Enforced by the database too, whoever writes to it.
    raw = sqlite3.connect(tmp_path / "r.sqlite")
    for stmt in ("UPDATE runs SET final_val_loss = 0", "DELETE FROM runs"):
        with pytest.raises(sqlite3.IntegrityError, match="never"):
            raw.execute(stmt)
    raw.close()


def test_restart_of_a_running_row_counts_attempts(tmp_path: Path) -> None:
    with ResultStore(tmp_path / "r.sqlite") as store:
        store.start_run(start("a"))
        assert store.start_run(start("a"))
        assert store.get("a").attempts == 2 and store.get("a").status == "running"


def test_refuses_foreign_and_newer_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ArchlabError, match="not a readable archlab results database"):
        ResultStore(junk)
    newer = tmp_path / "newer.sqlite"
    ResultStore(newer).close()
    raw = sqlite3.connect(newer)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    with pytest.raises(ArchlabError, match="upgrade archlab"):
        ResultStore(newer)
    with pytest.raises(ArchlabError, match="no results database"):
        ResultStore(tmp_path / "missing.sqlite", create=False)


def test_migrates_a_v1_database(tmp_path: Path) -> None:
    """A v1 file (runs and meta only) opens as the current version with every row intact, and takes
    downstream results; the migration changes nothing already stored."""
    from archlab.lab.store import _SCHEMA_V1

    db = tmp_path / "v1.sqlite"
    with ResultStore(tmp_path / "scratch.sqlite") as store:  # rows as a v1 writer stored them
        store.start_run(start("a"))
        store.finish_run("a", result(), final_val_loss=2.5, final_val_bpb=1.1)
        store.start_run(start("b"))
        store.set_meta("plan", {"x": 1})
    raw = sqlite3.connect(db, isolation_level=None)
    for stmt in _SCHEMA_V1:
        raw.execute(stmt)
    raw.execute(f"ATTACH DATABASE '{tmp_path / 'scratch.sqlite'}' AS old")
    v1_columns = ", ".join(r[1] for r in raw.execute("PRAGMA main.table_info(runs)"))
    raw.execute(f"INSERT INTO main.runs SELECT {v1_columns} FROM old.runs")
    raw.execute("INSERT INTO main.meta SELECT * FROM old.meta")
    raw.execute("DETACH DATABASE old")
    raw.execute("PRAGMA user_version = 1")
    raw.close()

    with ResultStore(db, create=False) as store:
        assert store.get("a").final_val_loss == 2.5 and store.get("b").status == "running"
        assert store.get_meta("plan") == {"x": 1} and store.downstream() == []
        store.add_downstream("a", {"piqa": {"acc": 0.5, "acc_stderr": 0.1, "acc_norm": 0.6, "acc_norm_stderr": 0.1,
                                            "n": 25}}, limit=None, sources={"piqa": "/t/piqa.jsonl"})
        with pytest.raises(sqlite3.IntegrityError, match="finished run"):
            store.add_downstream("b", {"piqa": {"acc": 0.5, "acc_stderr": 0.1, "n": 25}}, limit=None)
        (d,) = store.downstream("a")
        assert (d.task, d.limit, d.n, d.value, d.metric) == ("piqa", None, 25, 0.6, "acc_norm")
        assert d.source == "/t/piqa.jsonl"
        assert store.integrity_ok()
    raw = sqlite3.connect(db)
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 7
    with pytest.raises(sqlite3.IntegrityError, match="never"):
        raw.execute("UPDATE runs SET final_val_loss = 0 WHERE run_id = 'a'")  # v1's triggers still hold
    raw.close()


# A writer that finishes run "b" with a curve of several MB (so pages spill to the WAL before the
# commit) and is stopped inside that transaction, just before COMMIT, by the trace callback.
WRITER_MID_TRANSACTION = """
import sys, time
from pathlib import Path
from tests.lab.test_lab_store import start, result
from archlab.lab.store import ResultStore
store = ResultStore(Path(sys.argv[1]))
def trace(sql):
    if sql.strip().upper().startswith("COMMIT") and store._hold:
        Path(sys.argv[2]).write_text("in transaction")
        time.sleep(600)
store._hold = False
store._conn.set_trace_callback(trace)
store.start_run(start("b"))
store._hold = True
store.finish_run("b", result(loss=1.0, points=60000), final_val_loss=1.0, final_val_bpb=1.0)
"""


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"writer exited early: {proc.stderr.read() if proc.stderr else ''}")
        assert time.monotonic() < deadline, "writer never reached the point to kill it"
        time.sleep(0.05)


def test_writer_killed_mid_transaction_leaves_a_readable_database(tmp_path: Path) -> None:
    db = tmp_path / "r.sqlite"
    with ResultStore(db) as store:
        store.start_run(start("a"))
        store.finish_run("a", result(), final_val_loss=2.5, final_val_bpb=1.1)
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", WRITER_MID_TRANSACTION, str(db), str(marker)],
                            env=ENV, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(marker, proc)
        assert Path(f"{db}-wal").stat().st_size > 1_000_000  # the uncommitted write reached the WAL
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with ResultStore(db, create=False) as store:
        assert store.integrity_ok()
        assert store.get("a").status == "finished" and store.get("a").final_val_loss == 2.5
        b = store.get("b")
        assert b is not None and b.status == "running" and b.final_val_loss is None  # rolled back
        store.finish_run("b", result(), final_val_loss=2.0, final_val_bpb=1.0)  # and writable again
        assert store.get("b").status == "finished"


WRITER_LOOP = """
import sys
from pathlib import Path
from tests.lab.test_lab_store import start, result
from archlab.lab.store import ResultStore
store = ResultStore(Path(sys.argv[1]))
i = 0
while True:
    store.start_run(start(f"r{i}"))
    store.finish_run(f"r{i}", result(loss=float(i), points=3000), final_val_loss=float(i), final_val_bpb=1.0)
    print(i, flush=True)
    i += 1
"""


def test_writer_killed_at_random_moments_loses_nothing_committed(tmp_path: Path) -> None:
    db = tmp_path / "r.sqlite"
    committed: list[int] = []
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", WRITER_LOOP.replace('f"r{i}"', f'f"k{round_}-{{i}}"'),
                                 str(db)], env=ENV, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        first = proc.stdout.readline()  # at least one commit, then kill at an arbitrary point
        assert first.strip() == "0"
        time.sleep(0.3 + 0.2 * round_)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        done = [int(x) for x in [first, *proc.stdout.read().split()] if str(x).strip()]
        committed.append(len(done))
        with ResultStore(db, create=False) as store:
            assert store.integrity_ok()
            rows = {r.run_id: r for r in store.runs()}
            for i in done:  # every commit the writer reported is there, complete
                row = rows[f"k{round_}-{i}"]
                assert row.status == "finished" and row.final_val_loss == float(i)
                assert len(row.val_curve) == 3000
            unfinished = [r for r in rows.values() if r.status != "finished"]
            assert len(unfinished) <= round_ + 1  # at most the one row being written per kill
    assert all(c >= 1 for c in committed)


# Opens the store at argv[1] once the clock passes argv[2], so that several start together.
OPENER = """
import sys, time
from archlab.lab.store import ResultStore
t = float(sys.argv[2])
while time.time() < t:
    pass
with ResultStore(sys.argv[1]) as store:
    print(store.get_meta("missing"), flush=True)
"""


def test_processes_opening_a_new_database_at_once_all_get_it(tmp_path: Path) -> None:
    """Two compares started together on a new suite directory both create its database. SQLite
    does not wait for the lock while it switches a new file to WAL mode: before the store retried,
    3 processes opening one new file failed with "database is locked" 15 times in 40."""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"), "PATH": "/usr/bin:/bin"}
    for round_ in range(4):
        db = tmp_path / f"r{round_}.sqlite"
        go = time.time() + 1.5
        procs = [subprocess.Popen([sys.executable, "-c", OPENER, str(db), str(go)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0 and out.strip() == "None", err
        with ResultStore(db) as store:
            assert store._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
