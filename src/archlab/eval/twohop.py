"""The two-hop benchmark's tasks, ``twohop_id`` and ``twohop_ood``: where their items come from.

An item is ``{"context": "\\n e r1 r2", "target": answer}`` (``archlab.data.twohop``), scored as
LAMBADA is, so ``acc`` is exact match: every token of the answer is the model's greedy argmax
given the query (with the one-token names of the two-hop tokenizer, the first token greedy
decoding would emit). The items are found in this order:

1. ``<task_dir>/twohop_id.jsonl``: ``prepare`` writes the test splits of every ``twohop`` source
   into its data directory, so ``--task-dir DATA`` evaluates exactly the queries held out of
   DATA, whatever its options;
2. otherwise generated from the default options (``archlab.eval.tasks.find_task``). The lab
   reads a suite's tasks before it prepares the suite's data, and a built-in suite cannot name
   its own data directory (it lives under ``--out``), so a suite on the default ``twohop``
   source uses these, the same bytes as its data's files (the generator is deterministic across
   machines and Python versions).

Either way, before scoring, ``check_items_match_data`` compares the items with the files in the
directory the checkpoint was trained on, when it has them: a model trained on other options (or
data prepared by an older generator) fails with one line instead of being scored on queries
that were not held out of its training data.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from archlab.errors import DataError

#: task name -> the benchmark's test split
TASK_SPLITS = {"twohop_id": "id", "twohop_ood": "ood"}


def generated_rows(task: str) -> list[dict[str, str]]:
    """The items of ``task`` from the benchmark's default options, as uniform rows."""
    from archlab.data.twohop import generate

    return generate().task_rows(TASK_SPLITS[task])


def check_items_match_data(data_path: str | Path, loaded: dict[str, Sequence[Any]]) -> None:
    """Fail if two-hop items in ``loaded`` differ from the test files of the data directory a
    model was trained on (``data_path``; nothing is checked when it holds none, e.g. a model
    trained on another corpus, or data that is not on this machine)."""
    from archlab.data.twohop import TASK_FILES

    for task, items in loaded.items():
        if task not in TASK_SPLITS:
            continue
        path = Path(data_path) / TASK_FILES[TASK_SPLITS[task]]
        if not path.is_file():
            continue
        expected = _pairs(path, len(items))
        got = [(it.context, it.target) for it in items]
        if got != expected:
            raise DataError(f"{task}: these items are not the test queries held out of {data_path}, the "
                            f"data the checkpoint was trained on (pass --task-dir {data_path}, or "
                            f"eval.task_dir in a suite, to evaluate its own)")


def _pairs(path: Path, n: int) -> list[tuple[str, str]]:
    """(context, target) of the first ``n`` items of a task file."""
    out: list[tuple[str, str]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if len(out) == n:
                    break
                row = json.loads(line)
                out.append((row["context"], row["target"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path} is not a readable two-hop task file ({e.__class__.__name__}: {e})") from None
    return out
