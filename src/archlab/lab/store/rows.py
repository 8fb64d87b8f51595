"""The records the results store reads and writes: what a run is before it trains (``RunStart``),
what training returns (``TrainOutcome``), and one row of each table of measurements (``RunRow``,
``DownstreamRow``, ``LatencyRow``, ``HeldoutRow``). Plain frozen dataclasses, no SQL: the
store (``archlab.lab.store``) maps them to and from its tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

Status = Literal["running", "finished", "diverged"]


class TrainOutcome(Protocol):
    """What the lab needs from ``archlab.train.trainer.TrainResult``."""

    final_val_loss: float
    final_val_bpb: float
    val_curve: list[dict[str, Any]]
    train_curve: list[dict[str, Any]]
    tokens: int
    steps: int
    tokens_per_s: float
    wall_s: float
    device: str
    mfu: float | None
    params: int


@dataclass(frozen=True)
class RunStart:
    """Everything known about a run before it trains (from the suite plan)."""

    run_id: str
    suite: str
    label: str
    role: Literal["baseline", "variant"]
    init_seed: int
    data_seed: int
    config: dict[str, Any]
    config_hash: str
    code_revision: str
    planned_tokens: int
    planned_steps: int
    costs: dict[str, float]
    cost_context: int


@dataclass(frozen=True)
class RunRow:
    """One row of the ``runs`` table, curves decoded."""

    run_id: str
    suite: str
    label: str
    role: str
    init_seed: int
    data_seed: int
    status: Status
    config: dict[str, Any]
    config_hash: str
    code_revision: str
    planned_tokens: int
    planned_steps: int
    attempts: int
    started_at: float
    finished_at: float | None
    costs: dict[str, float | None]
    cost_context: int
    tokens: int | None
    steps: int | None
    final_val_loss: float | None
    final_val_bpb: float | None
    val_curve: list[dict[str, Any]]
    train_curve: list[dict[str, Any]]
    params_model: int | None
    tokens_per_s: float | None
    mfu: float | None
    wall_s: float | None
    device: str | None
    error: str | None
    runs_at_once: int | None = None  # most runs this host trained at once meanwhile (None: not known)
    # How final_val_loss was obtained (None: a row from before schema v6, whose final loss was the
    # mean of the suite's last eval.last_k evaluations), the final sample's tokens and the loss's
    # sampling standard error over it
    final_rule: str | None = None
    final_val_tokens: int | None = None
    final_val_se: float | None = None
    final_val_batches: list[list[float]] | None = None  # per batch of the final sample: [nats, tokens]



@dataclass(frozen=True)
class DownstreamRow:
    """One zero-shot evaluation of one finished run on one task."""

    run_id: str
    task: str
    limit: int | None  # the item limit asked for (None: every item)
    n: int  # items evaluated
    acc: float
    acc_stderr: float
    acc_norm: float | None
    acc_norm_stderr: float | None
    ppl: float | None
    source: str | None
    evaluated_at: float
    chance: float | None = None  # the headline metric's chance level (None: stored before schema v6)

    @property
    def metric(self) -> str:
        """The headline metric: acc_norm for multiple choice, acc for LAMBADA."""
        return "acc" if self.acc_norm is None else "acc_norm"

    @property
    def value(self) -> float:
        return self.acc if self.acc_norm is None else self.acc_norm

    @property
    def stderr(self) -> float:
        """Binomial standard error of ``value`` over the task's items."""
        return self.acc_stderr if self.acc_norm_stderr is None else self.acc_norm_stderr


@dataclass(frozen=True)
class LatencyRow:
    """One measured inference latency of one finished run (``archlab.infer.bench``)."""

    run_id: str
    phase: Literal["prefill", "decode"]
    batch: int
    requested: int  # the suite's prompt length (prefill) or context (decode)
    length: int  # what was measured: ``requested``, or the most the model's max_seq_len had room for
    max_seq_len: int | None
    steps: int  # timed repetitions (prefill) or decode steps (the median is over these)
    ms: float  # median ms of one prefill call / one decode step (one token for each sequence)
    timer: Literal["cuda-events", "wall-clock"]
    device: str
    dtype: str
    mfu: float | None
    roofline_ms: float | None
    bandwidth: float | None
    session: str
    code_revision: str | None
    measured_at: float

    @property
    def shape(self) -> tuple[str, int, int]:
        """What the suite asked for: (phase, batch, requested length)."""
        return (self.phase, self.batch, self.requested)


@dataclass(frozen=True)
class HeldoutRow:
    """One finished run's loss on one extra evaluation corpus (a suite's ``eval_data``)."""

    run_id: str
    corpus: str
    path: str
    tokenizer_sha: str
    loss: float
    bpb: float
    batches: int
    evaluated_at: float

