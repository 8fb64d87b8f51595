"""The results store: one SQLite file per suite directory, one row per run (``runs``), one
row per (run, downstream task, item limit) for zero-shot evaluations of finished runs
(``downstream``), and one row per (run, phase, batch, requested length) for measured inference
latency of finished runs (``latency``). This module owns the connection and every read and write
(``ResultStore``) and the claims' heartbeat thread (``Heartbeat``); the schema and its migrations
are ``archlab.lab.store.schema``, the records ``archlab.lab.store.rows``, the claims' records and
keys ``archlab.lab.store.claims`` (all re-exported by the package, so ``archlab.lab.store`` stays the one
import path).

Why SQLite: a comparison can take days, gets interrupted, and is read by reports while it is
still running. SQLite in WAL mode gives atomic, durable transactions (``synchronous=FULL``),
readers that never block the writer, and a file that a killed writer leaves readable: the
write-ahead log is either committed as a whole or ignored. Each public write is one transaction.

Invariants, enforced by the database itself (triggers), not only by this code: finished and
diverged runs and every stored measurement are never updated or deleted, and the schema version
lives in ``PRAGMA user_version`` (``archlab.lab.store.schema`` says which and why).

Claims (``claims``): a run being trained, or a finished run being evaluated downstream, is held by
the process doing it (``archlab.lab.store.owner``): taken atomically before the work (with the run's
row, in one transaction), refreshed by a heartbeat, and released when the work ends: by the very
transaction that records a run finished or diverged, so a run is always either claimed, or
recorded, or free to resume. A claim whose process is gone is taken over by the next claimant;
a live one is respected, so no run is ever trained by two processes at once. A ``running`` row
without a live claim is a run that was *interrupted* (``display_status``).
"""

from __future__ import annotations

import errno
import json
import os
import random
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from archlab.errors import ArchlabError
from archlab.lab.store.owner import Owner, heartbeat_s
from archlab.lab.store.claims import (LATENCY_KEY, Claim, ClaimResult, display_status, downstream_key,
                                      is_run_key)
from archlab.lab.store.rows import (DownstreamRow, HeldoutRow, LatencyRow, RunRow, RunStart, Status,
                                    TrainOutcome)
from archlab.lab.store.schema import (_MIGRATIONS, _SCHEMA_V1, _SCHEMA_V2, _SCHEMA_V3, _SCHEMA_V4, _SCHEMA_V5,
                                      _SCHEMA_V6, _SCHEMA_V7, COST_KEYS, SCHEMA_VERSION)

__all__ = [
    "COST_KEYS", "DB_NAME", "FINAL_WEIGHTS", "LATENCY_KEY", "SCHEMA_VERSION", "Claim", "ClaimResult", "DownstreamRow",
    "Heartbeat", "HeldoutRow", "LatencyRow", "ResultStore", "RunRow", "RunStart", "Status", "TrainOutcome",
    "_MIGRATIONS", "_SCHEMA_V1", "_SCHEMA_V2", "_SCHEMA_V3", "_SCHEMA_V4", "_SCHEMA_V5", "_SCHEMA_V6", "_SCHEMA_V7",
    "display_status",
    "downstream_key", "is_run_key",
]

DB_NAME = "results.sqlite"
#: ``runs.final_rule`` of a final loss that is the final weights' on the final evaluation sample
FINAL_WEIGHTS = "final weights"
LOCK_TIMEOUT_S = 60.0  # how long an open or a write waits for another process's lock


def _refuse_unwritable_folder(folder: Path) -> None:
    """SQLite in WAL mode cannot open a database it cannot create ``-shm`` / ``-wal`` beside: on a
    read-only file system or a folder without write permission the open fails as if the file
    were not a database. Say what is true instead (the command line prints it as one line)."""
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return
    if read_only:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(folder))
    if not os.access(folder, os.W_OK):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(folder))


def _opt(x: float | None) -> float | None:
    """NaN (an unmeasurable bandwidth on CPU) and None are stored as NULL."""
    return None if x is None or x != x else float(x)


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class ResultStore:
    """The suite's database; open it, use it from one thread, close it (or use ``with``)."""

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise ArchlabError(f"no results database at {self.path} (run archlab compare first)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: this class issues BEGIN/COMMIT itself, so one call is exactly
        # one transaction and nothing is left open implicitly.
        self._conn = sqlite3.connect(self.path, isolation_level=None, timeout=LOCK_TIMEOUT_S)
        self._conn.row_factory = sqlite3.Row
        try:
            self._open_with_retries()
        except sqlite3.DatabaseError as e:
            self._conn.close()
            _refuse_unwritable_folder(self.path.parent)
            raise ArchlabError(f"{self.path} is not a readable archlab results database ({e})") from None
        except BaseException:
            self._conn.close()
            raise

    def _open_with_retries(self) -> None:
        """WAL mode and the schema. Switching a new file to WAL is not covered by SQLite's busy
        timeout: two compares opening a new suite directory at once got "database is locked" at
        once (reproduced: 3 processes opening one new file, 15 of 40 times), so a locked database
        is tried again until ``LOCK_TIMEOUT_S``."""
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise ArchlabError(f"{self.path}: SQLite refused WAL mode (journal_mode={mode})")
                self._conn.execute("PRAGMA synchronous=FULL")
                self._init_schema()
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                time.sleep(0.02 + 0.05 * random.random())

    # ---- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE takes the write lock up front, so a write never fails half-way on a
        lock upgrade; any exception rolls the whole transaction back."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _init_schema(self) -> None:
        """Create the schema in a new file, or migrate an older one, in one transaction (a kill
        during a migration leaves the file at its old version)."""
        with self._transaction() as c:
            version = c.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                tables = c.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
                if tables:
                    raise ArchlabError(f"{self.path} is an SQLite file but not an archlab results database")
            elif version > SCHEMA_VERSION:
                raise ArchlabError(
                    f"{self.path} has results schema v{version}; this archlab reads up to "
                    f"v{SCHEMA_VERSION} (upgrade archlab)")
            if version < SCHEMA_VERSION:
                for step in _MIGRATIONS[version:]:
                    for stmt in step:
                        c.execute(stmt)
                c.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    # ---- suite metadata ---------------------------------------------------------------------
    def set_meta(self, key: str, value: Any) -> None:
        with self._transaction() as c:
            c.execute("INSERT INTO meta (key, value) VALUES (?, ?) "
                      "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, _dumps(value)))

    def get_meta(self, key: str) -> Any:
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    # ---- runs ------------------------------------------------------------------------------
    def start_run(self, start: RunStart) -> bool:
        """Record that a run is (re)starting, without a claim. Returns False, touching nothing, if
        the run is already finished or diverged; a second start of a running row counts an
        attempt. (``claim_run`` is what the lab uses: it also keeps other processes off the run.)"""
        with self._transaction() as c:
            row = c.execute("SELECT status FROM runs WHERE run_id = ?", (start.run_id,)).fetchone()
            if row is None:
                self._insert_run(c, start)
                return True
            if row["status"] != "running":
                return False
            c.execute("UPDATE runs SET attempts = attempts + 1, code_revision = ? WHERE run_id = ?",
                      (start.code_revision, start.run_id))
            return True

    @staticmethod
    def _insert_run(c: sqlite3.Connection, start: RunStart) -> None:
        cols = dict(
            run_id=start.run_id, suite=start.suite, label=start.label, role=start.role,
            init_seed=start.init_seed, data_seed=start.data_seed, status="running",
            config=_dumps(start.config), config_hash=start.config_hash,
            code_revision=start.code_revision, planned_tokens=start.planned_tokens,
            planned_steps=start.planned_steps, attempts=1, started_at=time.time(),
            cost_context=start.cost_context,
            **{k: start.costs[k] for k in COST_KEYS},
        )
        c.execute(f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                  tuple(cols.values()))

    def claim_run(self, start: RunStart, owner: Owner) -> ClaimResult:
        """Claim a run for ``owner`` to train, with its row, in one transaction: the row is
        created (or, for a running row, counted as another attempt) only when the claim is taken.
        A claim held by a gone process is taken over; ``busy`` when a live one holds it, ``done``
        when the run is finished or diverged (nothing is touched then)."""
        with self._transaction() as c:
            row = c.execute("SELECT status FROM runs WHERE run_id = ?", (start.run_id,)).fetchone()
            if row is not None and row["status"] != "running":
                return ClaimResult("done")
            got = self._take(c, start.run_id, owner)
            if got.state != "claimed":
                return got
            if row is None:
                self._insert_run(c, start)
            else:
                c.execute("UPDATE runs SET attempts = attempts + 1, code_revision = ? WHERE run_id = ?",
                          (start.code_revision, start.run_id))
            return got

    def claim(self, key: str, owner: Owner) -> ClaimResult:
        """Claim any other piece of work (a run's downstream evaluation: ``downstream_key``)."""
        with self._transaction() as c:
            return self._take(c, key, owner)

    def _take(self, c: sqlite3.Connection, key: str, owner: Owner) -> ClaimResult:
        """Inside a transaction: take ``key`` for ``owner`` unless a live other process holds it
        (claiming what ``owner`` already holds just renews it)."""
        held = c.execute("SELECT * FROM claims WHERE key = ?", (key,)).fetchone()
        taken_from = None
        if held is not None:
            claim = _claim(held)
            if claim.owner != owner and claim.alive(me=owner):
                return ClaimResult("busy", holder=claim.owner)
            if claim.owner != owner:
                taken_from = claim.owner
        now = time.time()
        c.execute("INSERT INTO claims (key, pid, host, boot, started, claimed_at, heartbeat_at) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET pid = excluded.pid, "
                  "host = excluded.host, boot = excluded.boot, started = excluded.started, "
                  "claimed_at = excluded.claimed_at, heartbeat_at = excluded.heartbeat_at",
                  (key, owner.pid, owner.host, owner.boot, owner.started, now, now))
        return ClaimResult("claimed", taken_from=taken_from)

    def release(self, key: str, owner: Owner) -> None:
        """Give up a claim ``owner`` holds (a claim since taken over by another is left alone)."""
        with self._transaction() as c:
            c.execute("DELETE FROM claims WHERE key = ? AND pid = ? AND host = ? AND boot = ? AND started = ?",
                      (key, owner.pid, owner.host, owner.boot, owner.started))

    def heartbeat(self, owner: Owner) -> int:
        """Refresh every claim ``owner`` holds; returns how many it holds."""
        with self._transaction() as c:
            return c.execute("UPDATE claims SET heartbeat_at = ? WHERE pid = ? AND host = ? AND boot = ? "
                             "AND started = ?", (time.time(), owner.pid, owner.host, owner.boot,
                                                 owner.started)).rowcount

    def claims(self) -> dict[str, Claim]:
        return {r["key"]: _claim(r) for r in self._conn.execute("SELECT * FROM claims ORDER BY claimed_at")}

    def live_claims(self, me: Owner | None = None) -> dict[str, Claim]:
        """The claims whose process still exists (as seen from ``me``, by default this process)."""
        now = time.time()
        return {k: c for k, c in self.claims().items() if c.alive(me=me, now=now)}

    def runs_on_host(self, me: Owner | None = None) -> int:
        """How many runs processes on ``me``'s host are training now (live run claims there)."""
        me = me or Owner.current()
        return sum(1 for k, c in self.live_claims(me).items()
                   if is_run_key(k) and c.owner.host == me.host and c.owner.boot == me.boot)

    def finish_run(self, run_id: str, result: TrainOutcome, *, final_val_loss: float,
                   final_val_bpb: float, runs_at_once: int | None = None,
                   final_rule: str = FINAL_WEIGHTS) -> None:
        """Store a completed run's measurements and mark it finished (one transaction, which also
        drops the run's claim). ``final_rule`` says how the final loss was obtained: the final
        weights on the final sample (the trainer's, whose sample size and standard error are
        stored with it), or ``mean of last k ...``."""
        tokens = getattr(result, "final_val_tokens", None)
        se = getattr(result, "final_val_se", None)
        batches = getattr(result, "final_val_batches", None)
        self._end(run_id, "finished", dict(
            tokens=int(result.tokens), steps=int(result.steps), final_val_loss=float(final_val_loss),
            final_val_bpb=float(final_val_bpb), val_curve=_dumps(list(result.val_curve)),
            train_curve=_dumps(list(result.train_curve)), params_model=int(result.params),
            tokens_per_s=float(result.tokens_per_s),
            mfu=None if result.mfu is None else float(result.mfu), wall_s=float(result.wall_s),
            device=str(result.device), runs_at_once=runs_at_once, final_rule=final_rule,
            final_val_tokens=None if tokens is None else int(tokens), final_val_se=_opt(se),
            final_val_batches=None if batches is None else _dumps(batches)))

    def mark_diverged(self, run_id: str, message: str) -> None:
        """A run whose loss became non-finite: a result too (the variant is unstable here)."""
        self._end(run_id, "diverged", dict(error=message))

    def _end(self, run_id: str, status: Status, values: dict[str, Any]) -> None:
        values = dict(values, status=status, finished_at=time.time())
        sets = ", ".join(f"{k} = ?" for k in values)
        with self._transaction() as c:
            cur = c.execute(f"UPDATE runs SET {sets} WHERE run_id = ? AND status = 'running'",
                            (*values.values(), run_id))
            if cur.rowcount != 1:
                raise RuntimeError(f"run {run_id} is not running in {self.path}; cannot mark it {status}")
            c.execute("DELETE FROM claims WHERE key = ?", (run_id,))

    # ---- downstream evaluations ---------------------------------------------------------------
    def add_downstream(self, run_id: str, results: dict[str, dict[str, Any]], *, limit: int | None,
                       sources: dict[str, str] | None = None) -> None:
        """Store a finished run's zero-shot results (``archlab.eval.evaluate``'s dict: per task
        acc, acc_stderr, n and acc_norm(_stderr) or ppl), all tasks in one transaction."""
        def opt(r: dict[str, Any], key: str) -> float | None:
            return None if r.get(key) is None else float(r[key])

        now = time.time()
        with self._transaction() as c:
            for task, r in results.items():
                c.execute(
                    "INSERT INTO downstream (run_id, task, item_limit, n, acc, acc_stderr, acc_norm, "
                    "acc_norm_stderr, ppl, source, evaluated_at, chance) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (run_id, task, limit or 0, int(r["n"]), float(r["acc"]), float(r["acc_stderr"]),
                     opt(r, "acc_norm"), opt(r, "acc_norm_stderr"), opt(r, "ppl"), (sources or {}).get(task), now,
                     opt(r, "chance")))

    def downstream(self, run_id: str | None = None) -> list[DownstreamRow]:
        """Downstream results, of one run or of every run, in the order they were stored."""
        sql = "SELECT * FROM downstream" + (" WHERE run_id = ?" if run_id is not None else "")
        rows = self._conn.execute(sql + " ORDER BY evaluated_at, run_id, task",
                                  () if run_id is None else (run_id,))
        return [DownstreamRow(
            run_id=r["run_id"], task=r["task"], limit=r["item_limit"] or None, n=r["n"], acc=r["acc"],
            acc_stderr=r["acc_stderr"], acc_norm=r["acc_norm"], acc_norm_stderr=r["acc_norm_stderr"],
            ppl=r["ppl"], source=r["source"], evaluated_at=r["evaluated_at"], chance=r["chance"]) for r in rows]

    # ---- measured latency ---------------------------------------------------------------------
    def add_latency(self, rows: list["LatencyRow"]) -> None:
        """Store measured latencies (of finished runs), all in one transaction."""
        with self._transaction() as c:
            for r in rows:
                c.execute(
                    "INSERT INTO latency (run_id, phase, batch, requested, length, max_seq_len, steps, ms, timer, "
                    "device, dtype, mfu, roofline_ms, bandwidth, session, code_revision, measured_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (r.run_id, r.phase, int(r.batch), int(r.requested), int(r.length), r.max_seq_len,
                     int(r.steps), float(r.ms), r.timer, r.device, r.dtype, _opt(r.mfu), _opt(r.roofline_ms),
                     _opt(r.bandwidth), r.session, r.code_revision, float(r.measured_at)))

    def latency(self, run_id: str | None = None) -> list["LatencyRow"]:
        """Measured latencies, of one run or of every run, in the order they were stored."""
        sql = "SELECT * FROM latency" + (" WHERE run_id = ?" if run_id is not None else "")
        rows = self._conn.execute(sql + " ORDER BY measured_at, run_id, phase, batch",
                                  () if run_id is None else (run_id,))
        return [LatencyRow(**{k: r[k] for k in r.keys()}) for r in rows]

    # ---- extra evaluation corpora ---------------------------------------------------------------
    def add_heldout(self, rows: list[HeldoutRow]) -> None:
        """Store finished runs' held-out losses, all in one transaction. A (run, corpus) already
        stored (by a compare sharing the suite directory) keeps its first result."""
        with self._transaction() as c:
            for r in rows:
                c.execute("INSERT OR IGNORE INTO heldout (run_id, corpus, path, tokenizer_sha, loss, bpb, batches, "
                          "evaluated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                          (r.run_id, r.corpus, r.path, r.tokenizer_sha, float(r.loss), float(r.bpb),
                           int(r.batches), float(r.evaluated_at)))

    def heldout(self, run_id: str | None = None) -> list[HeldoutRow]:
        """Held-out losses, of one run or of every run, in the order they were stored."""
        sql = "SELECT * FROM heldout" + (" WHERE run_id = ?" if run_id is not None else "")
        rows = self._conn.execute(sql + " ORDER BY evaluated_at, run_id, corpus",
                                  () if run_id is None else (run_id,))
        return [HeldoutRow(**{k: r[k] for k in r.keys()}) for r in rows]

    # ---- reading ---------------------------------------------------------------------------
    def get(self, run_id: str) -> RunRow | None:
        row = self._conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return None if row is None else _row(row)

    def runs(self) -> list[RunRow]:
        return [_row(r) for r in self._conn.execute("SELECT * FROM runs ORDER BY started_at, run_id")]

    def integrity_ok(self) -> bool:
        return self._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def _row(r: sqlite3.Row) -> RunRow:
    return RunRow(
        run_id=r["run_id"], suite=r["suite"], label=r["label"], role=r["role"],
        init_seed=r["init_seed"], data_seed=r["data_seed"], status=r["status"],
        config=json.loads(r["config"]), config_hash=r["config_hash"],
        code_revision=r["code_revision"], planned_tokens=r["planned_tokens"],
        planned_steps=r["planned_steps"], attempts=r["attempts"], started_at=r["started_at"],
        finished_at=r["finished_at"], costs={k: r[k] for k in COST_KEYS},
        cost_context=r["cost_context"], tokens=r["tokens"], steps=r["steps"],
        final_val_loss=r["final_val_loss"], final_val_bpb=r["final_val_bpb"],
        val_curve=json.loads(r["val_curve"]) if r["val_curve"] else [],
        train_curve=json.loads(r["train_curve"]) if r["train_curve"] else [],
        params_model=r["params_model"], tokens_per_s=r["tokens_per_s"], mfu=r["mfu"],
        wall_s=r["wall_s"], device=r["device"], error=r["error"], runs_at_once=r["runs_at_once"],
        final_rule=r["final_rule"], final_val_tokens=r["final_val_tokens"], final_val_se=r["final_val_se"],
        final_val_batches=json.loads(r["final_val_batches"]) if r["final_val_batches"] else None,
    )


def _claim(r: sqlite3.Row) -> Claim:
    return Claim(key=r["key"], owner=Owner(pid=r["pid"], host=r["host"], boot=r["boot"], started=r["started"]),
                 claimed_at=r["claimed_at"], heartbeat_at=r["heartbeat_at"])


class Heartbeat:
    """While a process trains or evaluates, refresh its claims every ``every`` seconds (by default
    ``archlab.lab.store.owner.heartbeat_s``) from a
    thread (with its own connection: a SQLite connection belongs to one thread), and sample how
    many runs this host is training (``peak``: the most seen, the run's ``runs_at_once``).

    Use as a context manager around the work; a failed refresh (the database busy for longer
    than its timeout) is retried on the next beat rather than ending the work."""

    def __init__(self, path: str | Path, owner: Owner, every: float | None = None) -> None:
        self.path, self.owner, self.every = Path(path), owner, heartbeat_s() if every is None else every
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="archlab-claim-heartbeat", daemon=True)

    def sample(self, store: "ResultStore") -> int:
        self.peak = max(self.peak, store.runs_on_host(self.owner))
        return self.peak

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            try:
                with ResultStore(self.path, create=False) as store:
                    store.heartbeat(self.owner)
                    self.sample(store)
            except (sqlite3.Error, ArchlabError):
                continue

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
