"""The documents of archlab's lm-eval task configs: archlab's own task readers (``archlab.eval.tasks``)
over the local task folders, so lm-eval sees exactly the items ``archlab eval`` scores.

Each config names this module's ``load_docs`` as its ``custom_dataset`` and its archlab task in
``dataset_kwargs``; the task folder is ``task_dir`` from ``--metadata '{"task_dir": ...}'``, else
``$ARCHLAB_TASK_DIR`` (``archlab lm-eval --task-dir DIR`` sets it). A task whose data is not there
fails when lm-eval builds it, with archlab's one line naming the places it looked.
"""

from __future__ import annotations

from typing import Any


def item_doc(item) -> dict[str, Any]:
    """One archlab item as an lm-eval document (field names the configs refer to).

    Choices lose the one leading space that lm-eval's ``target_delimiter`` puts back, so the
    requests are archlab's text exactly and ``acc_norm`` counts what lm-eval counts."""
    from archlab.eval.tasks import MCItem

    def bare(text: str) -> str:
        return text[1:] if text.startswith(" ") else text

    if not isinstance(item, MCItem):  # cloze: scored as (context, " " + target)
        return {"context": item.context, "continuation": " " + item.target}
    if item.contexts is not None:  # partial scoring (WinoGrande): one context per choice, one continuation
        return {"contexts": list(item.contexts), "target": bare(item.continuations[0]), "gold": item.gold}
    return {"context": item.context, "choices": [bare(c) for c in item.continuations], "gold": item.gold}


def load_docs(task: str, split: str = "validation", task_dir: str | None = None, **_lm_eval_metadata: Any):
    """``{split: Dataset}`` of an archlab task (lm-eval's ``custom_dataset`` hook; ``split`` is the
    name the config reads it under, from its ``dataset_kwargs``)."""
    import datasets

    from archlab.eval.tasks import find_task, load_task

    items = load_task(task, find_task(task, task_dir))
    return {split: datasets.Dataset.from_list([item_doc(it) for it in items])}
