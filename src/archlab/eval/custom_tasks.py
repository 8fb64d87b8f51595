"""Tasks of your own: any multiple-choice or cloze data under a name you choose.

``archlab eval --tasks NAME=SOURCE`` with a NAME archlab does not know reads SOURCE as one of:

* **a data file or folder with the uniform fields** (JSONL, ``.jsonl.gz``, Arrow, Parquet, a
  ``save_to_disk`` or ``dataset_dict`` folder): ``{"context", "continuations", "gold"}`` rows make
  a multiple-choice task, ``{"context", "target"}`` rows a cloze task (scored like LAMBADA: the
  target's tokens all greedy given the context);
* **a task spec** (``.yaml``/``.yml``) that maps a dataset's own fields, e.g. for SciQ-shaped rows::

      kind: mc                      # mc | cloze
      data: sciq/validation.jsonl   # relative to this file; any of the formats above
      split: validation             # the split a dataset_dict / parquet folder is read from
      context: "{support}\\nQuestion: {question}\\nAnswer:"
      choices: ["{distractor1}", "{distractor2}", "{distractor3}", "{correct_answer}"]
      gold: 3                       # an index, or a field: gold_field: label
      # gold_kind: index (default) | one_based | text (the field holds the answer text)
      #            | label (the field holds one of the labels in the field named by labels:)
      # delimiter: " "              # put between the context and each choice (lm-eval's default)

  ``context``, each entry of ``choices`` and a cloze ``target`` are Python format templates over
  the row (``{field}``, ``{field[key]}``); ``choices`` may instead name a field that holds the
  list of choices (dotted for nested fields: ``choices.text``).

Every mistake in a spec (unknown key, wrong type, a template naming a missing field) is one line
naming the file, and the key or the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archlab.errors import DataError
from archlab.eval.items import Item, LambadaItem, MCItem, Row, check_gold

SPEC_SUFFIXES = (".yaml", ".yml")
GOLD_KINDS = ("index", "one_based", "text", "label")
_KEYS = {"kind", "data", "split", "context", "choices", "gold", "gold_field", "gold_kind", "labels", "target",
         "delimiter"}


def is_task_spec_file(path: Path) -> bool:
    return path.suffix in SPEC_SUFFIXES and path.is_file()


@dataclass(frozen=True)
class CustomTask:
    """A parsed task spec (field meanings in the module docstring)."""

    name: str
    kind: str  # "mc" or "cloze"
    data: Path
    split: str | None
    context: str
    choices: tuple[str, ...] | str  # templates, or the dotted field holding the list
    gold: int | None  # a fixed answer index ...
    gold_field: str | None  # ... or the dotted field that holds it
    gold_kind: str
    labels: str | None
    target: str | None
    delimiter: str
    where: str

    def item(self, row: Row) -> Item:
        context = _fill(self.context, row, "context")
        if self.kind == "cloze":
            target = _fill(self.target or "", row, "target").strip()
            if not target:
                raise DataError(f"{row.where}: the target is empty")
            return LambadaItem(context, target)
        if isinstance(self.choices, str):
            choices = _field(row, self.choices)
            if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices) or len(choices) < 2:
                raise DataError(f"{row.where}: field {self.choices!r} must be a list of at least 2 strings")
        else:
            choices = [_fill(t, row, "choices") for t in self.choices]
        return MCItem(context, tuple(self.delimiter + c for c in choices), self._gold(row, choices))

    def _gold(self, row: Row, choices: list[str]) -> int:
        if self.gold is not None:
            return check_gold(row, self.gold, len(choices), "gold")
        value = _field(row, self.gold_field or "")
        if self.gold_kind == "text":
            if value not in choices:
                raise DataError(f"{row.where}: field {self.gold_field!r} is {value!r}, not one of the choices")
            return choices.index(value)
        if self.gold_kind == "label":
            labels = _field(row, self.labels or "")
            if not isinstance(labels, list) or str(value).strip() not in [str(x) for x in labels]:
                raise DataError(f"{row.where}: field {self.gold_field!r} is {value!r}, not one of the labels "
                                f"in {self.labels!r}")
            return [str(x) for x in labels].index(str(value).strip())
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise DataError(f"{row.where}: field {self.gold_field!r} must be an integer, got {value!r}")
        return check_gold(row, value - (self.gold_kind == "one_based"), len(choices), self.gold_field or "gold")


def _field(row: Row, dotted: str) -> Any:
    value: Any = row.data
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value or value[part] is None:
            have = ", ".join(sorted(value)) if isinstance(value, dict) else type(value).__name__
            raise DataError(f"{row.where}: missing field {dotted!r} (fields present: {have})")
        value = value[part]
    return value


def _fill(template: str, row: Row, key: str) -> str:
    try:
        return template.format_map(row.data)
    except (KeyError, IndexError) as e:
        have = ", ".join(sorted(row.data)) or "none"
        raise DataError(f"{row.where}: the {key} template {template!r} names {e.args[0]!r}, not in the row "
                        f"(fields present: {have})") from None
    except (ValueError, AttributeError) as e:
        raise DataError(f"{row.where}: the {key} template {template!r} is not a valid format string ({e})") from None


def read_task_spec(name: str, path: Path) -> CustomTask:
    """A task spec file, checked key by key."""
    import yaml

    where = str(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise DataError(f"{where} is not readable YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise DataError(f"{where}: a task spec is a mapping of keys ({', '.join(sorted(_KEYS))})")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise DataError(f"{where}: unknown key {unknown[0]!r}; a task spec has {', '.join(sorted(_KEYS))}")

    def text(key: str, default: str | None = None) -> str | None:
        value = raw.get(key, default)
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: {key!r} must be a string, got {value!r}")
        return value

    kind = text("kind")
    if kind not in ("mc", "cloze"):
        raise DataError(f"{where}: 'kind' must be mc or cloze, got {kind!r}")
    data = text("data")
    if not data:
        raise DataError(f"{where}: 'data' (the task's data file or folder) is missing")
    data_path = (path.parent / data) if not Path(data).is_absolute() else Path(data)
    if not data_path.exists():
        raise DataError(f"{where}: 'data' is {data_path}, which does not exist")
    context = text("context", "{context}") or ""
    choices: tuple[str, ...] | str = ()
    gold, gold_field, target = None, None, None
    gold_kind = text("gold_kind", "index") or "index"
    if kind == "cloze":
        target = text("target", "{target}")
    else:
        value = raw.get("choices")
        if isinstance(value, str):
            choices = value
        elif isinstance(value, list) and len(value) >= 2 and all(isinstance(v, str) for v in value):
            choices = tuple(value)
        else:
            raise DataError(f"{where}: 'choices' must name the field holding the choices or list at least 2 "
                            f"templates, got {value!r}")
        gold, gold_field = raw.get("gold"), text("gold_field")
        if (gold is None) == (gold_field is None):
            raise DataError(f"{where}: give exactly one of 'gold' (a fixed index) and 'gold_field'")
        if gold is not None and (isinstance(gold, bool) or not isinstance(gold, int) or gold < 0):
            raise DataError(f"{where}: 'gold' must be a non-negative integer, got {gold!r}")
        if gold_kind not in GOLD_KINDS:
            raise DataError(f"{where}: 'gold_kind' must be one of {', '.join(GOLD_KINDS)}, got {gold_kind!r}")
        if (gold_kind == "label") != ("labels" in raw):
            raise DataError(f"{where}: 'labels' (the field listing the choice labels) goes with gold_kind: label")
    return CustomTask(name, kind, data_path, text("split"), context, choices, gold, gold_field, gold_kind,
                      text("labels"), target, text("delimiter", " ") or "", where)


def spec_split(path: Path) -> str:
    """The split a spec file names, else the one its data path's names say."""
    from archlab.eval.tasks import split_of

    task = read_task_spec(path.stem, path)
    return task.split or split_of(task.name, task.data)


def _uniform_any(row: Row) -> Item:
    from archlab.eval import native

    if row.has("continuations"):
        return native.uniform_mc(row)
    if row.has("target"):
        return native.uniform_lambada(row)
    have = ", ".join(sorted(row.data)) or "none"
    raise DataError(f"{row.where}: a task of your own needs the uniform fields (context, continuations, gold "
                    f"or context, target) or a task spec .yaml that maps its fields (fields present: {have})")


def custom_spec(name: str, source: Path):
    """(a ``tasks.TaskSpec`` whose rows all go through the mapping, the data path) for a task of
    your own: ``source`` is a task spec file or a data file/folder with the uniform fields."""
    from archlab.eval.tasks import MC_SPLITS, TaskSpec

    if source.suffix in SPEC_SUFFIXES:
        task = read_task_spec(name, source)
        splits = (task.split,) if task.split else MC_SPLITS
        return TaskSpec(name, "mc" if task.kind == "mc" else "lambada", task.item, (), "", splits,
                        mapped=True), task.data
    return TaskSpec(name, "any", _uniform_any, (), "", MC_SPLITS, mapped=True), source
