"""Extra evaluation corpora (a suite's ``eval_data``): every finished run's final checkpoint,
evaluated on the validation split of each named prepared data directory.

In-distribution loss says how well a variant fits the corpus it trained on; a held-out corpus
(another domain, prepared with the *same tokenizer*) says whether a gain transfers. The loss is
the trainer's own evaluation (``archlab.train.trainer.Run.evaluate``: the same validation windows,
batch size, sequence length, ``train.eval_batches`` and bits-per-byte definition as the run's
in-distribution figure), pointed at the other directory, so the two columns of the report are
measured the same way. A loss in nats/token is only comparable across corpora tokenized alike,
hence the tokenizer check: the corpus's ``tokenizer.json`` must be byte-identical (sha256) to the
one the run trained with (the copy in its checkpoint); otherwise one line says which differs.

Results go to the ``heldout`` table (store schema v5), one row per (run, corpus), never
overwritten. What a finished run lacks (a corpus added to the suite later, an evaluation
interrupted by the end of a call) is evaluated on the next ``compare``, without retraining;
a run whose checkpoint is gone is reported and left without.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from archlab.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from archlab.config import RunConfig
    from archlab.lab.plan import Plan, PlannedRun
    from archlab.lab.store import ResultStore

TOKENIZER = "tokenizer.json"


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def corpus_tokenizer_sha(origin: str, name: str, path: str) -> str:
    """The sha256 of a held-out corpus's tokenizer; one-line ``ConfigError`` when it is not there."""
    data = Path(path)
    if not (data / "manifest.json").is_file():
        raise ConfigError(f"suite error: {origin}: eval_data.{name}: {data} is not a prepared data directory "
                          "(no manifest.json; see archlab data prepare)")
    tok = data / TOKENIZER
    if not tok.is_file():
        raise ConfigError(f"suite error: {origin}: eval_data.{name}: {data} has no {TOKENIZER}")
    return file_sha256(tok)


def check_tokenizer(origin: str, name: str, path: str, run_tokenizer: Path) -> str:
    """The corpus's tokenizer sha256, after checking it is the run's; one line if it is not."""
    mine = corpus_tokenizer_sha(origin, name, path)
    theirs = file_sha256(run_tokenizer)
    if mine != theirs:
        raise ConfigError(f"suite error: {origin}: eval_data.{name}: {path} was prepared with another tokenizer "
                          f"(sha256 {mine[:12]}) than the runs' ({run_tokenizer}, sha256 {theirs[:12]}); "
                          "held-out losses are comparable only under the same tokenizer")
    return mine


def evaluate_heldout(run_dir: Path, cfg: "RunConfig", data_path: str) -> tuple[float, float, int]:
    """(loss, bits per byte, batches) of the final checkpoint in ``run_dir`` on the validation split of
    ``data_path``, by the trainer's own ``Run.evaluate`` on the run's device."""
    from archlab.io import checkpoint as ckpt_io
    from archlab.train.trainer import Run

    ck = ckpt_io.resolve_checkpoint(run_dir)
    # The run's config with the other corpus; no compilation or CUDA graph: one evaluation pass.
    other = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(data_path)),
                                train=dataclasses.replace(cfg.train, compile=False, cuda_graph=False))
    run = Run(other, Path(run_dir))
    ckpt_io.load_weights(run.model, ckpt_io.load_tensors(ck, "model"), ck)
    loss, bpb = run.evaluate()
    return loss, bpb, cfg.train.eval_batches


HeldoutFn = Callable[[Path, "RunConfig", str], tuple[float, float, int]]


def evaluate_missing(plan: "Plan", store: "ResultStore", runs: list["PlannedRun"], console: "Console",
                     fn: HeldoutFn | None = None) -> int:
    """Evaluate every finished run of ``runs`` on each suite corpus it lacks; returns how many
    (run, corpus) results were stored. Tokenizer mismatches fail before any evaluation."""
    from archlab.lab.display import RUNS_DIR
    from archlab.lab.store import HeldoutRow

    corpora = plan.suite.eval_data
    if not corpora:
        return 0
    have = {(h.run_id, h.corpus) for h in store.heldout()}
    todo = []
    for run in runs:
        row = store.get(run.run_id)
        if row is None or row.status != "finished":
            continue
        missing = [c for c in corpora if (run.run_id, c) not in have]
        if missing:
            todo.append((run, missing))
    if not todo:
        return 0
    fn = fn or evaluate_heldout
    stored = 0
    for run, missing in todo:
        run_dir = plan.out_dir / RUNS_DIR / run.run_id
        try:
            tok = ckpt_tokenizer(run_dir)
        except CheckpointError as e:
            console.print(f"[yellow]{run.label} seed {run.init_seed}: no held-out evaluation[/yellow]: {e}",
                          highlight=False)
            continue
        shas = {c: check_tokenizer(plan.suite.origin, c, corpora[c], tok) for c in missing}
        rows = []
        for c in missing:
            loss, bpb, batches = fn(run_dir, run.config, corpora[c])
            rows.append(HeldoutRow(run_id=run.run_id, corpus=c, path=corpora[c], tokenizer_sha=shas[c],
                                   loss=loss, bpb=bpb, batches=batches, evaluated_at=time.time()))
        store.add_heldout(rows)
        stored += len(rows)
        console.print(f"{run.label} seed {run.init_seed} held-out: "
                      + ", ".join(f"{r.corpus} {r.loss:.4f}" for r in rows), highlight=False)
    return stored


def ckpt_tokenizer(run_dir: Path) -> Path:
    """The tokenizer the run trained with: the copy in its latest checkpoint."""
    from archlab.io.checkpoint import resolve_checkpoint

    tok = resolve_checkpoint(run_dir) / TOKENIZER
    if not tok.is_file():
        raise CheckpointError(f"checkpoint of {run_dir} has no {TOKENIZER}")
    return tok


def precheck(plan: "Plan") -> None:
    """Before training: every corpus is a prepared directory whose tokenizer is the one of the
    runs' data (where that is prepared already), so a mismatch fails now, not after hours."""
    for name, path in plan.suite.eval_data.items():
        corpus_tokenizer_sha(plan.suite.origin, name, path)
        for data in {r.config.data.path for r in plan.runs}:
            tok = Path(data) / TOKENIZER
            if tok.is_file():
                check_tokenizer(plan.suite.origin, name, path, tok)
