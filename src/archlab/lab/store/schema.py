"""The results database's schema: the SQL that builds each version from the previous one
(``_MIGRATIONS``), the current version (``SCHEMA_VERSION``) and the cost columns of the ``runs``
table (``COST_KEYS``). ``archlab.lab.store.ResultStore`` applies the steps when it opens a file.

Invariants, enforced by the database itself (triggers), not only by the store's code:

* a row whose status is ``finished`` or ``diverged`` is never updated or deleted, so nothing
  measured is lost or silently replaced;
* a ``downstream`` row belongs to a finished run, and is never updated or deleted either (a new
  item limit is a new row, so results with other limits stay as they were measured); the same
  for a ``latency`` row (another prompt, context or batch size is another row);
* the schema version lives in ``PRAGMA user_version``; a file from a newer archlab is refused
  rather than misread, and an older one is migrated when opened (``_MIGRATIONS``; each step
  only adds tables or nullable columns, so nothing already stored changes).

Schema versions: v1, the ``runs`` and ``meta`` tables; v2 (downstream evaluation) adds the
``downstream`` table and its triggers; v3 adds the ``claims`` table and ``runs.runs_at_once``
(how many runs this host was training at once while the run trained, sampled: the context its
tokens/s was measured in); v4 (measured cost) adds the ``latency`` table and its triggers; v5
(extra evaluation corpora) adds the ``heldout`` table (a finished run's loss on each of the suite's
``eval_data`` corpora) and its triggers; v6 (final losses of the final weights) adds to ``runs`` how
the final loss was obtained (``final_rule``) and the final evaluation's sample size and sampling
standard error, and to ``downstream`` each task's chance level; v7 adds the final sample's
per-batch losses (``runs.final_val_batches``), from which the report computes the sample's error in
a paired difference.
"""

from __future__ import annotations

SCHEMA_VERSION = 7

# The cost columns of METHODOLOGY.md, as returned by ``archlab.model.accounting.costs``.
COST_KEYS: tuple[str, ...] = (
    "params_total",
    "params_active",
    "params_embedding",
    "train_flops_per_token",
    "prefill_flops_per_token",
    "decode_flops_per_token",
    "kv_bytes_per_token",
    "decode_bytes_per_step",
)

def _finished_results_only(table: str, noun: str) -> tuple[str, str, str]:
    """Triggers that make ``table`` append-only results of finished runs: an insert for a run that
    is not finished, any update and any delete abort with one line naming the ``noun``. (The SQL
    text is what earlier versions wrote out for each table, so migrated databases hold the same.)"""
    return (
        f"""CREATE TRIGGER {table}_of_finished_runs_only BEFORE INSERT ON {table}
       WHEN (SELECT status FROM runs WHERE run_id = NEW.run_id) IS NOT 'finished'
       BEGIN SELECT RAISE(ABORT, 'archlab: {noun} results belong to a finished run'); END""",
        f"""CREATE TRIGGER {table}_no_update BEFORE UPDATE ON {table}
       BEGIN SELECT RAISE(ABORT, 'archlab: a {noun} result is never overwritten'); END""",
        f"""CREATE TRIGGER {table}_no_delete BEFORE DELETE ON {table}
       BEGIN SELECT RAISE(ABORT, 'archlab: a {noun} result is never deleted'); END""",
    )


# The schema of each version as the statements that build it from the previous one. Never edit a
# released step (databases in the field were built by it); add a step and bump SCHEMA_VERSION.
_SCHEMA_V1: tuple[str, ...] = (
    """CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)""",
    """CREATE TABLE runs (
        run_id TEXT PRIMARY KEY,
        suite TEXT NOT NULL,
        label TEXT NOT NULL,
        role TEXT NOT NULL CHECK (role IN ('baseline', 'variant')),
        init_seed INTEGER NOT NULL,
        data_seed INTEGER NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('running', 'finished', 'diverged')),
        config TEXT NOT NULL,
        config_hash TEXT NOT NULL,
        code_revision TEXT NOT NULL,
        planned_tokens INTEGER NOT NULL,
        planned_steps INTEGER NOT NULL,
        attempts INTEGER NOT NULL,
        started_at REAL NOT NULL,
        finished_at REAL,
        params_total INTEGER,
        params_active INTEGER,
        params_embedding INTEGER,
        train_flops_per_token REAL,
        prefill_flops_per_token REAL,
        decode_flops_per_token REAL,
        kv_bytes_per_token REAL,
        decode_bytes_per_step REAL,
        cost_context INTEGER NOT NULL,
        tokens INTEGER,
        steps INTEGER,
        final_val_loss REAL,
        final_val_bpb REAL,
        val_curve TEXT,
        train_curve TEXT,
        params_model INTEGER,
        tokens_per_s REAL,
        mfu REAL,
        wall_s REAL,
        device TEXT,
        error TEXT
    )""",
    """CREATE TRIGGER runs_terminal_no_update BEFORE UPDATE ON runs
       WHEN OLD.status != 'running'
       BEGIN SELECT RAISE(ABORT, 'archlab: a finished run is never overwritten'); END""",
    """CREATE TRIGGER runs_terminal_no_delete BEFORE DELETE ON runs
       WHEN OLD.status != 'running'
       BEGIN SELECT RAISE(ABORT, 'archlab: a finished run is never deleted'); END""",
)

_SCHEMA_V2: tuple[str, ...] = (
    """CREATE TABLE downstream (
        run_id TEXT NOT NULL REFERENCES runs (run_id),
        task TEXT NOT NULL,
        item_limit INTEGER NOT NULL CHECK (item_limit >= 0),  -- 0: every item of the task
        n INTEGER NOT NULL CHECK (n > 0),
        acc REAL NOT NULL,
        acc_stderr REAL NOT NULL,
        acc_norm REAL,              -- multiple choice only
        acc_norm_stderr REAL,
        ppl REAL,                   -- LAMBADA only
        source TEXT,                -- where the task data was read from
        evaluated_at REAL NOT NULL,
        PRIMARY KEY (run_id, task, item_limit)
    )""",
    *_finished_results_only("downstream", "downstream"),
)

_SCHEMA_V3: tuple[str, ...] = (
    """CREATE TABLE claims (
        key TEXT PRIMARY KEY,       -- a run id, or 'downstream:' + run id for its evaluation
        pid INTEGER NOT NULL,
        host TEXT NOT NULL,
        boot TEXT NOT NULL,         -- archlab.lab.store.owner.Owner.boot
        started TEXT NOT NULL,      -- the process's start time, to tell a reused pid
        claimed_at REAL NOT NULL,
        heartbeat_at REAL NOT NULL
    )""",
    "ALTER TABLE runs ADD COLUMN runs_at_once INTEGER",
)

_SCHEMA_V4: tuple[str, ...] = (
    """CREATE TABLE latency (
        run_id TEXT NOT NULL REFERENCES runs (run_id),
        phase TEXT NOT NULL CHECK (phase IN ('prefill', 'decode')),
        batch INTEGER NOT NULL CHECK (batch > 0),
        requested INTEGER NOT NULL CHECK (requested > 0),  -- the suite's prompt (prefill) or context
        length INTEGER NOT NULL CHECK (length > 0),  -- measured at: below requested when the model's
                                                     -- max_seq_len had no room for it
        max_seq_len INTEGER,        -- the model's
        steps INTEGER NOT NULL CHECK (steps > 0),    -- timed repetitions (prefill) / decode steps
        ms REAL NOT NULL,           -- median: one prefill call / one decode step of the batch
        timer TEXT NOT NULL CHECK (timer IN ('cuda-events', 'wall-clock')),
        device TEXT NOT NULL,       -- archlab.io.device.device_name
        dtype TEXT NOT NULL,        -- weights and KV cache
        mfu REAL,                   -- prefill, against the device's peak (None: unknown peak)
        roofline_ms REAL,           -- decode: bytes per step / measured copy bandwidth
        bandwidth REAL,             -- measured device copy bandwidth, bytes/s
        session TEXT NOT NULL,      -- one measuring pass: ratios within one are from the same run
        code_revision TEXT,
        measured_at REAL NOT NULL,
        PRIMARY KEY (run_id, phase, batch, requested)
    )""",
    *_finished_results_only("latency", "latency"),
)

_SCHEMA_V5: tuple[str, ...] = (
    """CREATE TABLE heldout (
        run_id TEXT NOT NULL REFERENCES runs (run_id),
        corpus TEXT NOT NULL,       -- the suite's eval_data name
        path TEXT NOT NULL,         -- the prepared data directory, as the suite named it
        tokenizer_sha TEXT NOT NULL, -- sha256 of its tokenizer.json (= the run's)
        loss REAL NOT NULL,         -- mean NLL, nats/token, on its validation split
        bpb REAL NOT NULL,
        batches INTEGER NOT NULL CHECK (batches > 0),
        evaluated_at REAL NOT NULL,
        PRIMARY KEY (run_id, corpus)
    )""",
    *_finished_results_only("heldout", "held-out"),
)

_SCHEMA_V6: tuple[str, ...] = (
    # NULL in rows from before v6: their final loss was the mean of the last eval.last_k evaluations
    "ALTER TABLE runs ADD COLUMN final_rule TEXT",  # 'final weights', or 'mean of last k (steps a-b)'
    "ALTER TABLE runs ADD COLUMN final_val_tokens INTEGER",  # tokens of the final evaluation's sample
    "ALTER TABLE runs ADD COLUMN final_val_se REAL",  # its sampling standard error of the final loss
    "ALTER TABLE downstream ADD COLUMN chance REAL",  # the task's chance level of the headline metric
)

_SCHEMA_V7: tuple[str, ...] = (
    "ALTER TABLE runs ADD COLUMN final_val_batches TEXT",  # JSON [[summed nats, tokens], ...] per batch
)

# _MIGRATIONS[v - 1] takes a database from version v - 1 to v (version 0: an empty file).
_MIGRATIONS: tuple[tuple[str, ...], ...] = (_SCHEMA_V1, _SCHEMA_V2, _SCHEMA_V3, _SCHEMA_V4, _SCHEMA_V5,
                                            _SCHEMA_V6, _SCHEMA_V7)
assert len(_MIGRATIONS) == SCHEMA_VERSION
