"""``archlab merge DIR OTHER...``: bring the results of other directories of the same suite into one.

This is how a suite is split across machines without sharing one SQLite file (which WAL mode
forbids on a network filesystem): each machine trains its share into a directory of its own
(``compare --shard I/N --out DIR``), the directories are copied to one machine, and merged
there. It is also how the results of a suite run on a remote machine (a device call) come back
into a local directory that has results of its own.

What is imported: every run that is finished or diverged in OTHER and not in DIR, with its whole
``runs`` row (every column, as recorded there), its ``downstream``, ``latency`` and ``heldout``
rows, and its run directory (copied whole: config, metrics, checkpoints, so downstream evaluation
and latency measurement can still use the final checkpoint here). A run that is ``running`` here
(interrupted) is replaced by the finished one, its directory too; one being trained here right
now (a live claim) is left alone.

What is refused, before anything is written:

* OTHER is another suite: its stored plan names another suite;
* OTHER holds a finished run whose id is not in DIR's plan. A run id hashes the suite's name, the
  run's label, seeds and config, so such a run was trained under another config (other ``--set``
  overrides, another budget, an edited suite file) and would compare apples with oranges; the
  whole merge is refused rather than importing part of it;
* a compare is running in DIR or in OTHER (their suite lock is held): a merge needs both still.

A run finished in both with different results (final loss, bits per byte, steps, tokens) is
reported and ours kept; the others are still merged, and the command exits 1 so a script
notices. Finished in both with the same results (a merge done before, or a deterministic
re-run) is nothing to do: merging twice changes nothing.

OTHER is never modified: its database is read from a private copy (opening a WAL database, even
read-only, may create its ``-wal``/``-shm`` files, and an older schema would be migrated), and its
run directories are only read. DIR's rows are inserted in one transaction, after the run
directories are in place (each copied under a temporary name and renamed): a merge killed
half-way leaves at most finished-looking run directories without rows, which a compare resumes
from their final checkpoints or a second merge completes.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from archlab.errors import ArchlabError
from archlab.lab.display import RUNS_DIR
from archlab.lab.store import DB_NAME, ResultStore, RunRow, downstream_key

_TERMINAL = ("finished", "diverged")
# What makes two finished copies of a run the same result; wall time, dates and the host differ
# between two trainings of a run even when the trainer is deterministic.
_RESULT_COLUMNS = ("status", "steps", "tokens", "final_val_loss", "final_val_bpb")
_CHILD_TABLES = ("downstream", "latency", "heldout")


@dataclass
class MergeOutcome:
    imported: list[str] = field(default_factory=list)  # run ids brought into DIR
    same: int = 0  # finished in both with the same result: nothing to do
    conflicts: list[str] = field(default_factory=list)  # finished in both, results differ: ours kept
    busy: list[str] = field(default_factory=list)  # being trained here right now: left alone
    notes: list[str] = field(default_factory=list)  # one line per conflict or skipped run


@contextmanager
def _locked(out_dir: Path, *, other: bool) -> Iterator[None]:
    """The suite lock, exclusive: no compare may claim, train or record runs here while rows and
    directories are moved in. OTHER's lock file is opened read-only and only if it is there (a
    lock is not a modification; creating the file would be)."""
    lock = out_dir / ".lock"
    if other and not lock.exists():
        yield
        return
    fd = os.open(lock, os.O_RDONLY if other else os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArchlabError(f"an archlab compare is running in {out_dir}; merge when it has finished") from None
        yield
    finally:
        os.close(fd)


def _snapshot(other: Path, into: Path) -> Path:
    """A private copy of OTHER's database (with its write-ahead log, whose committed transactions
    are part of the database until checkpointed), to open without touching OTHER."""
    src = other / DB_NAME
    if not src.is_file():
        raise ArchlabError(f"no results database at {src}: not a suite directory")
    dst = into / DB_NAME
    shutil.copyfile(src, dst)
    wal = other / (DB_NAME + "-wal")
    if wal.is_file():
        shutil.copyfile(wal, into / (DB_NAME + "-wal"))
    return dst


def _suite_name(store: ResultStore, where: Path) -> str:
    plan = store.get_meta("plan")
    if not isinstance(plan, dict) or "suite" not in plan:
        raise ArchlabError(f"{where} has no suite plan in {DB_NAME} (run archlab compare there first)")
    return str(plan["suite"]["name"])


def _planned_ids(store: ResultStore) -> set[str]:
    return {str(r["run_id"]) for r in store.get_meta("plan")["runs"]}


def _same_result(ours: RunRow, theirs: RunRow) -> bool:
    return all(getattr(ours, c) == getattr(theirs, c) for c in _RESULT_COLUMNS)


def _rows(conn: sqlite3.Connection, table: str, run_id: str) -> list[sqlite3.Row]:
    return conn.execute(f"SELECT * FROM {table} WHERE run_id = ?", (run_id,)).fetchall()


def _place_dir(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` under a temporary name in ``dst``'s directory, then rename it in,
    so ``dst`` is never half-copied; an interrupted run's directory already at ``dst`` is set
    aside first and removed last."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".merge-{dst.name}-", dir=dst.parent))
    old = None
    try:
        shutil.copytree(src, tmp / "run", symlinks=True)
        if dst.exists():
            old = tmp / "old"
            os.rename(dst, old)
        os.rename(tmp / "run", dst)
    except BaseException:
        if old is not None and not dst.exists():
            os.rename(old, dst)  # put the interrupted run back where a compare resumes it
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def merge_dirs(out_dir: Path, others: list[Path]) -> MergeOutcome:
    """Merge every directory of ``others`` into ``out_dir``, one after another (see the module)."""
    outcome = MergeOutcome()
    for d in (out_dir, *others):  # before any lock file is created anywhere
        if not (d / DB_NAME).is_file():
            raise ArchlabError(f"{d} is not a suite directory: it has no {DB_NAME} (run `archlab compare` "
                               "there first, or name the directory a compare wrote)")
    for other in others:
        if other.resolve() == out_dir.resolve():
            raise ArchlabError(f"{other} is the directory being merged into")
        _merge_one(out_dir, other, outcome)
    return outcome


def _merge_one(out_dir: Path, other: Path, outcome: MergeOutcome) -> None:
    with ExitStack() as stack:
        stack.enter_context(_locked(out_dir, other=False))
        stack.enter_context(_locked(other, other=True))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="archlab-merge-")))
        store = stack.enter_context(ResultStore(out_dir / DB_NAME, create=False))
        theirs = stack.enter_context(ResultStore(_snapshot(other, tmp), create=False))
        name, their_name = _suite_name(store, out_dir), _suite_name(theirs, other)
        if name != their_name:
            raise ArchlabError(f"{other} holds suite {their_name!r}, {out_dir} suite {name!r}; nothing merged")
        planned = _planned_ids(store)
        done = [r for r in theirs.runs() if r.status in _TERMINAL]
        foreign = [r.run_id for r in done if r.run_id not in planned]
        if foreign:
            raise ArchlabError(f"{other}: run {foreign[0]} ({len(foreign)} in all) is not in {out_dir}'s plan: "
                               "trained under another config (overrides, budget or suite file); nothing merged")
        live = store.live_claims()
        todo: list[RunRow] = []
        for run in done:
            ours = store.get(run.run_id)
            if ours is not None and ours.status in _TERMINAL:
                if _same_result(ours, run):
                    outcome.same += 1
                else:
                    outcome.conflicts.append(run.run_id)
                    outcome.notes.append(
                        f"{run.run_id}: {ours.status} in both with different results (here loss "
                        f"{ours.final_val_loss}, {ours.steps} steps; {other}: loss {run.final_val_loss}, "
                        f"{run.steps} steps); kept this directory's")
            elif run.run_id in live:
                outcome.busy.append(run.run_id)
                outcome.notes.append(f"{run.run_id}: being trained here by {live[run.run_id].describe()}; "
                                     "left alone (merge again when it ends)")
            else:
                todo.append(run)
        for run in todo:
            src = other / RUNS_DIR / run.run_id
            if src.is_dir():  # a row without its directory still carries the result
                _place_dir(src, out_dir / RUNS_DIR / run.run_id)
        _insert(store, theirs, todo)
        outcome.imported.extend(r.run_id for r in todo)


def _insert(store: ResultStore, theirs: ResultStore, runs: list[RunRow]) -> None:
    """Every row of ``runs`` and of their results, in one transaction of ``store``. An
    interrupted (``running``) row here is deleted first (allowed: only terminal rows are
    protected), and so is its stale claim."""
    if not runs:
        return
    src = theirs._conn
    with store._transaction() as c:
        for run in runs:
            c.execute("DELETE FROM claims WHERE key IN (?, ?)", (run.run_id, downstream_key(run.run_id)))
            c.execute("DELETE FROM runs WHERE run_id = ? AND status = 'running'", (run.run_id,))
            for table in ("runs", *_CHILD_TABLES):
                for row in _rows(src, table, run.run_id):
                    cols = row.keys()
                    c.execute(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                              tuple(row))


def describe(outcome: MergeOutcome) -> str:
    """The closing line of ``archlab merge``."""
    parts = [f"{len(outcome.imported)} runs merged", f"{outcome.same} already here"]
    if outcome.busy:
        parts.append(f"{len(outcome.busy)} being trained here (left alone)")
    if outcome.conflicts:
        parts.append(f"{len(outcome.conflicts)} with different results here (kept ours)")
    return ", ".join(parts)

