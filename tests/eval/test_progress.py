"""The progress bar counts items, not the scorer's requests."""

from __future__ import annotations

from archlab.eval.items import LambadaItem, MCItem
from archlab.eval.progress import ItemCounter, requests_per_item, task_progress


def test_item_counter_turns_requests_into_items():
    items = [MCItem("a", (" x", " y", " z"), 0), LambadaItem("b", "w"), MCItem("c", (" x", " y"), 1)]
    assert requests_per_item(items) == [3, 1, 2]
    counter = ItemCounter(items)
    assert counter.advance(2) == 0  # the first item's 3 requests are not all scored yet
    assert counter.advance(2) == 2  # 4 requests: the first two items
    assert counter.advance(1) == 0
    assert counter.advance(1) == 1 and counter.items == 3


def test_task_progress_walks_the_tasks_in_order():
    loaded = {"one": [MCItem("a", (" x", " y"), 0)] * 2, "two": [LambadaItem("b", "w")] * 3}
    with task_progress(loaded, enabled=False) as advance:
        assert advance is None
    with task_progress(loaded) as advance:
        advance(3)  # 1.5 items of "one"
        advance(4)  # the rest of "one" and 3 of "two": batches may span tasks
        advance(5)  # past the end: ignored
    assert [(t.description, t.completed, t.total) for t in advance.bar.tasks] == [("one", 2, 2), ("two", 3, 3)]
