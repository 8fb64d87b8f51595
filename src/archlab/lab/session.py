"""A suite spread over several bounded sessions (device calls of a few minutes each).

``archlab compare --max-runs N`` starts at most N runs in this call; ``--time-budget SECONDS``
starts a run only when the time this call has used plus the run's expected time still fits.
The rest is left for the next call, which finds the finished runs in the suite directory and
skips them (a suite directory carries everything: the database, and run directories whose
checkpoints let an interrupted run continue; nothing in them is an absolute path that ties them
to one machine, ``archlab.lab.plan._portable_hash``).

The expected time of a run is its tokens still to train over the tokens/s expected for its label
(``archlab.lab.display._rate``: measured in finished runs of the suite, else the baseline's scaled
by FLOPs, else the suite's ``estimate.tokens_per_s``). It covers training only: downstream and
held-out evaluation and latency measurement are not in it, so leave them a margin. Without any
estimate the first run of the call is started (nothing else can tell), later ones are not.
A run expected to take longer than the whole budget is never started by a budgeted call; it
needs a bigger budget (or a smaller ``budget.tokens``): each run must fit in one call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from archlab.lab.fmt import duration, plural

if TYPE_CHECKING:
    from archlab.lab.plan import Plan, PlannedRun
    from archlab.lab.store import RunRow


@dataclass
class Session:
    """The limits of one ``compare`` call, and what it held back."""

    max_runs: int | None = None
    seconds: float | None = None  # wall-clock budget of the call, from its start
    amend_seeds: bool = False  # archlab.lab.stoprule: run a seed plan changed after results
    started: float = field(default_factory=time.monotonic)
    begun: int = 0  # runs started in this call
    held_back: list[str] = field(default_factory=list)  # run ids not started
    reasons: list[str] = field(default_factory=list)

    @property
    def limited(self) -> bool:
        return self.max_runs is not None or self.seconds is not None

    def admit(self, plan: "Plan", rows: dict[str, "RunRow"], run: "PlannedRun") -> bool:
        """Whether ``run`` may start now; if not, it is held back (and so is every later one:
        runs are started in plan order, so the next call picks up where this one stopped)."""
        if self.held_back:
            self.held_back.append(run.run_id)
            return False
        why = self._refusal(plan, rows, run)
        if why is not None:
            self.held_back.append(run.run_id)
            self.reasons.append(why)
            return False
        self.begun += 1
        return True

    def _refusal(self, plan: "Plan", rows: dict[str, "RunRow"], run: "PlannedRun") -> str | None:
        if self.max_runs is not None and self.begun >= self.max_runs:
            return f"--max-runs {self.max_runs} reached"
        if self.seconds is None:
            return None
        need = expected_seconds(plan, rows, run)
        used = time.monotonic() - self.started
        if need is None:
            return None if self.begun == 0 else "no time estimate for the next run (set estimate.tokens_per_s)"
        if need > self.seconds:
            return (f"{run.label} seed {run.init_seed} needs about {duration(need)}, more than the whole "
                    f"--time-budget of {duration(self.seconds)}: size runs to fit one call")
        if used + need > self.seconds:
            return (f"the next run needs about {duration(need)} and {duration(max(0.0, self.seconds - used))} "
                    "of the --time-budget is left")
        return None

    def summary(self) -> str | None:
        """The line ``compare`` ends with when runs were held back."""
        if not self.held_back:
            return None
        return (f"{plural(len(self.held_back), 'run')} left for another call ({self.reasons[0]}); "
                "run the same compare again, here or on a copy of the suite directory, to continue")


def expected_seconds(plan: "Plan", rows: dict[str, "RunRow"], run: "PlannedRun") -> float | None:
    """Training time still needed by ``run`` at its label's expected tokens/s (module doc)."""
    from archlab.lab.display import RUNS_DIR, _rate, latest_train_record

    rate, _ = _rate(plan, {k: v for k, v in rows.items() if v is not None}, run.label)
    if not rate:
        return None
    rec = latest_train_record(plan.out_dir / RUNS_DIR / run.run_id)
    done = int(rec.get("tokens", 0)) if rec is not None else 0  # a run resumed from a checkpoint
    return max(0, run.tokens - done) / rate
