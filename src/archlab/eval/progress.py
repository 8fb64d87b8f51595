"""A progress bar for task evaluation that counts items (not the scorer's requests), with the
rate in items per second and the time left."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from contextlib import contextmanager
from itertools import accumulate

from archlab.eval.items import Item, MCItem


def requests_per_item(items: Sequence[Item]) -> list[int]:
    return [len(it.continuations) if isinstance(it, MCItem) else 1 for it in items]


class ItemCounter:
    """Turns the scorer's "k more requests scored" calls into "items now complete".

    The scorer works through requests sorted by length, so an item counts as done when as many
    requests as it and every item before it hold have been scored: exact at the end, and a close
    running estimate before (the rate and the time left are what the bar is for)."""

    def __init__(self, items: Sequence[Item]):
        self.ends = list(accumulate(requests_per_item(items)))
        self.requests = 0
        self.items = 0

    def advance(self, k: int) -> int:
        """Add ``k`` scored requests; the number of items that became complete."""
        self.requests += k
        done = bisect.bisect_right(self.ends, self.requests)
        new, self.items = done - self.items, done
        return new


@contextmanager
def task_progress(loaded: dict[str, Sequence[Item]], enabled: bool = True):
    """Yields a callback for ``evaluate_tasks(progress=...)`` that draws one bar per task on
    stderr (items done / all, items/s, time left); nothing is drawn when ``enabled`` is false or
    stderr is not a terminal."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    from rich.text import Text

    class ItemsPerSecond(ProgressColumn):
        def render(self, task):
            return Text("- items/s" if task.speed is None else f"{task.speed:,.1f} items/s")

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), ItemsPerSecond(),
                   TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=Console(stderr=True),
                   transient=True)
    advance = _Advance(bar, loaded)
    with bar:
        yield advance


class _Advance:
    """The callback: the scorer reports requests in task order, so a batch that fills one task's
    bar carries on into the next one's; requests past the last task are ignored."""

    def __init__(self, bar, loaded: dict[str, Sequence[Item]]):
        self.bar = bar
        self.jobs = [(bar.add_task(name, total=len(items)), ItemCounter(items)) for name, items in loaded.items()]
        self.at = 0

    def __call__(self, k: int) -> None:
        while k > 0 and self.at < len(self.jobs):
            job, counter = self.jobs[self.at]
            step = min(k, counter.ends[-1] - counter.requests)
            self.bar.advance(job, counter.advance(step))
            k -= step
            if counter.requests >= counter.ends[-1]:
                self.at += 1
