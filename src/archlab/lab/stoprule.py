"""Stop rules fixed before the run: a suite's seeds are registered with its first results, and a
later change is refused (or, when forced, voids the verdicts).

Why: adding seeds until a difference becomes significant ("optional stopping") inflates the false
positive rate far beyond alpha, and so does dropping seeds that went the wrong way. The defence a
statistician accepts is pre-registration: the number of seeds per label is part of the design,
declared in the suite file before anything trains. archlab enforces it on the suite directory:

* The first ``compare`` of a suite directory records the **seed plan** (every label's
  (init seed, data seed) pairs, and a hash of them) in the database's ``meta`` table.
* A later ``compare`` whose suite gives an already registered label other seed pairs is refused
  with one line while any run of the suite has finished (a result may have been seen). Before any
  run finished the new plan simply replaces the old one (nothing was seen yet). Adding a variant
  (a new label) is not a change of an existing label's seeds and is registered quietly.
* ``compare --amend-seeds`` runs the changed plan anyway and records the change; from then on the
  report shows every test but draws no verdict from it (``INVALID``), and says why in its overview.
  A new suite directory (``--out``) is the honest way to run a bigger design.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import TYPE_CHECKING, Any

from archlab.errors import ConfigError

if TYPE_CHECKING:
    from archlab.lab.plan import Plan
    from archlab.lab.store import ResultStore

INVALID = "not valid: seeds changed after results"
_PLAN_KEY = "seed_plan"
_CHANGES_KEY = "seed_plan_changes"


def seed_plan(plan: "Plan") -> dict[str, list[list[int]]]:
    """Every label's (init seed, data seed) pairs in the plan, sorted."""
    out: dict[str, list[list[int]]] = {}
    for r in plan.runs:
        out.setdefault(r.label, []).append([r.init_seed, r.data_seed])
    return {label: sorted(pairs) for label, pairs in out.items()}


def plan_hash(seeds: dict[str, list[list[int]]]) -> str:
    return hashlib.sha256(json.dumps(seeds, sort_keys=True).encode()).hexdigest()[:12]


def _describe(old: dict[str, list[list[int]]], new: dict[str, list[list[int]]]) -> str:
    parts = []
    for label in sorted(set(old) & set(new)):
        a, b = {tuple(p) for p in old[label]}, {tuple(p) for p in new[label]}
        if a == b:
            continue
        added, removed = sorted(b - a), sorted(a - b)
        what = ([f"adds {_pairs(added)}"] if added else []) + ([f"drops {_pairs(removed)}"] if removed else [])
        parts.append(f"{label} {' and '.join(what)}")
    return "; ".join(parts)


def _pairs(pairs: list[tuple[int, ...]]) -> str:
    return ", ".join(f"init {i}/data {d}" for i, d in pairs)


def check_seed_plan(store: "ResultStore", plan: "Plan", *, amend: bool = False) -> str | None:
    """Register the plan's seeds, or check them against the registered ones (module doc). Returns
    a line to show when something was re-registered or amended; raises ``ConfigError`` when the
    seeds changed after results and ``amend`` is not set."""
    current = seed_plan(plan)
    registered = store.get_meta(_PLAN_KEY)
    now = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    if registered is None:
        store.set_meta(_PLAN_KEY, {"hash": plan_hash(current), "seeds": current, "registered_at": now})
        return None
    old: dict[str, list[list[int]]] = registered["seeds"]
    change = _describe(old, current)
    merged = {**old, **current}  # labels no longer in the suite keep their registered seeds
    if not change:
        if merged != old:  # a new variant: its seeds are registered with it
            store.set_meta(_PLAN_KEY, dict(registered, hash=plan_hash(merged), seeds=merged))
        return None
    finished = sum(r.status == "finished" for r in store.runs())
    if finished == 0:
        store.set_meta(_PLAN_KEY, {"hash": plan_hash(merged), "seeds": merged, "registered_at": now})
        return f"seed plan changed before any result ({change}); registered the new one"
    if not amend:
        raise ConfigError(
            f"suite error: {plan.suite.origin}: seeds: changed after {finished} run(s) finished ({change}); "
            "seeds are fixed before the runs: use a new --out for a bigger design, or --amend-seeds to run "
            "it with every verdict marked not valid")
    changes = list(store.get_meta(_CHANGES_KEY) or [])
    changes.append({"what": change, "finished": finished, "at": now, "from": registered["hash"],
                    "to": plan_hash(merged)})
    store.set_meta(_CHANGES_KEY, changes)
    store.set_meta(_PLAN_KEY, {"hash": plan_hash(merged), "seeds": merged, "registered_at": now})
    return f"seeds changed after {finished} finished run(s) ({change}): the report will draw no verdicts"


def seed_plan_changes(store: "ResultStore") -> list[dict[str, Any]]:
    """The recorded changes of a registered seed plan after results (``--amend-seeds``)."""
    return list(store.get_meta(_CHANGES_KEY) or [])
