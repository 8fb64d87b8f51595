"""The ``claims`` table's records and keys: a claim held by a process (``Claim``), the outcome
of trying to take one (``ClaimResult``), the keys of work that is not a run being trained
(``downstream_key``, ``LATENCY_KEY``, ``is_run_key``) and the status a person should read for a
run row given the live claims (``display_status``). Who holds a claim and whether it is alive is
``archlab.lab.store.owner``; taking, refreshing and releasing them is ``archlab.lab.store.ResultStore``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from archlab.lab.store.owner import Owner, holder_alive
from archlab.lab.store.rows import RunRow


@dataclass(frozen=True)
class Claim:
    """A run (or its downstream evaluation) held by a process."""

    key: str
    owner: Owner
    claimed_at: float
    heartbeat_at: float

    def alive(self, me: Owner | None = None, now: float | None = None) -> bool:
        return holder_alive(self.owner, self.heartbeat_at, me=me, now=now)


@dataclass(frozen=True)
class ClaimResult:
    """``claimed``: this process holds it now (``taken_from``: the gone process it took it over
    from, if any); ``busy``: a live process holds it (``holder``); ``done``: the run is already
    finished or diverged."""

    state: Literal["claimed", "busy", "done"]
    holder: Owner | None = None
    taken_from: Owner | None = None


def downstream_key(run_id: str) -> str:
    """The claim key of a run's downstream evaluation."""
    return f"downstream:{run_id}"


# The claim key of a suite's latency measurements: one process measures at a time (two measuring
# at once on one host would distort each other's timings). A run id never holds a colon (labels
# are letters, digits and _ . + -), so keys with one are never runs.
LATENCY_KEY = "latency:suite"


def is_run_key(key: str) -> bool:
    """Whether a claim key is a run being trained (not an evaluation or a measurement)."""
    return ":" not in key


def display_status(row: RunRow, live: set[str] | dict[str, Any]) -> str:
    """The status a person should read: a ``running`` row whose claim is not live (``live``: the
    keys of live claims, ``ResultStore.live_claims``) is ``interrupted``: nothing trains it."""
    if row.status != "running":
        return row.status
    return "running" if row.run_id in live else "interrupted"
