"""Tasks of your own: uniform-field files of any format under a user-given name, and task spec
.yaml files that map a dataset's own fields; their mistakes are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from archlab.errors import DataError
from archlab.eval.harness import Score, evaluate_items
from archlab.eval.tasks import LambadaItem, MCItem, load_task, load_tasks, parse_task_list, split_of

MC_ROWS = [{"context": "2 + 2 =", "continuations": [" 4", " 5"], "gold": 0},
           {"context": "The sky is", "continuations": [" green", " blue", " red"], "gold": 1}]
CLOZE_ROWS = [{"context": "The capital of France is", "target": "Paris"}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_any_name_with_uniform_fields_in_jsonl_and_parquet(tmp_path):
    jsonl = write_jsonl(tmp_path / "arith.jsonl", MC_ROWS)
    parquet_dir = tmp_path / "capitals" / "data"
    parquet_dir.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(CLOZE_ROWS), parquet_dir / "validation-00000-of-00001.parquet")
    loaded = load_tasks(f"my_arith={jsonl},capitals={tmp_path / 'capitals'}")
    assert loaded["my_arith"] == [MCItem("2 + 2 =", (" 4", " 5"), 0), MCItem("The sky is", (" green", " blue", " red"), 1)]
    assert loaded["capitals"] == [LambadaItem("The capital of France is", "Paris")]
    assert split_of("capitals", tmp_path / "capitals") == "file"
    assert split_of("capitals", parquet_dir / "validation-00000-of-00001.parquet") == "validation"
    # the kind follows the items: a cloze task is scored by greedy exact match
    res = evaluate_items("capitals", loaded["capitals"], lambda reqs: [Score(-0.5, True, 1) for _ in reqs])
    assert res["acc"] == 1.0 and "ppl" in res


def test_a_task_spec_maps_native_fields(tmp_path):
    rows = [{"q": "Which is a planet?", "opts": {"text": ["Mars", "Moon"], "label": ["A", "B"]}, "key": "A"},
            {"q": "Which is a star?", "opts": {"text": ["Earth", "Sun"], "label": ["A", "B"]}, "key": "B"}]
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "planets.jsonl", rows)
    spec = tmp_path / "planets.yaml"
    spec.write_text("kind: mc\ndata: data/planets.jsonl\nsplit: test\ncontext: \"Question: {q}\\nAnswer:\"\n"
                    "choices: opts.text\ngold_field: key\ngold_kind: label\nlabels: opts.label\n")
    items = load_task("planets", spec)
    assert items == [MCItem("Question: Which is a planet?\nAnswer:", (" Mars", " Moon"), 0),
                     MCItem("Question: Which is a star?\nAnswer:", (" Earth", " Sun"), 1)]
    assert split_of("planets", spec) == "test"
    # templates per choice, a fixed gold, one-based and text gold, and a cloze spec
    spec.write_text("kind: mc\ndata: data/planets.jsonl\ncontext: '{q}'\nchoices: ['{opts[text][1]}', "
                    "'{opts[text][0]}']\ngold: 1\ndelimiter: ''\n")
    assert load_task("planets", spec)[0] == MCItem("Which is a planet?", ("Moon", "Mars"), 1)
    write_jsonl(tmp_path / "data" / "n.jsonl", [{"q": "x", "a": "1", "b": "2", "ans": 2, "word": "two"}])
    spec.write_text("kind: mc\ndata: data/n.jsonl\nchoices: ['{a}', '{b}']\ncontext: '{q}'\ngold_field: ans\n"
                    "gold_kind: one_based\n")
    assert load_task("n", spec)[0].gold == 1
    spec.write_text("kind: mc\ndata: data/n.jsonl\nchoices: ['{a}', '{word}']\ncontext: '{q}'\ngold_field: word\n"
                    "gold_kind: text\n")
    assert load_task("n", spec)[0].gold == 1
    spec.write_text("kind: cloze\ndata: data/n.jsonl\ncontext: 'one plus one is'\ntarget: '{word}'\n")
    assert load_task("n", spec) == [LambadaItem("one plus one is", "two")]


@pytest.mark.parametrize("text, words", [
    ("kind: mcq\ndata: d.jsonl\n", ["'kind' must be mc or cloze"]),
    ("kind: mc\ndata: nowhere.jsonl\nchoices: c\ngold: 0\n", ["does not exist"]),
    ("kind: mc\ndata: d.jsonl\nchoices: c\n", ["exactly one of 'gold'"]),
    ("kind: mc\ndata: d.jsonl\nchoices: c\ngold: 0\nprompt: x\n", ["unknown key 'prompt'"]),
    ("kind: mc\ndata: d.jsonl\nchoices: ['{a}']\ngold: 0\n", ["'choices' must name"]),
    ("kind: mc\ndata: d.jsonl\nchoices: c\ngold_field: g\ngold_kind: label\n", ["'labels'"]),
    ("kind: mc\ndata: d.jsonl\ncontext: '{question}'\nchoices: c\ngold: 0\n", ["line 1", "names 'question'"]),
    ("kind: mc\ndata: d.jsonl\nchoices: c\ngold: 5\n", ["line 1", "answer index 5"]),
    ("kind: mc\ndata: d.jsonl\nchoices: missing.field\ngold: 0\n", ["line 1", "missing field 'missing.field'"]),
    ("[a, b\n", ["not readable YAML"]),
])
def test_task_spec_mistakes_are_one_line(tmp_path, text, words):
    write_jsonl(tmp_path / "d.jsonl", [{"context": "q", "c": ["a", "b"], "g": "x", "a": "y"}])
    spec = tmp_path / "t.yaml"
    spec.write_text(text)
    with pytest.raises(DataError) as e:
        load_task("t", spec)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_user_task_mistakes(tmp_path):
    with pytest.raises(DataError, match="unknown task 'mine'.*mine=FILE"):
        parse_task_list("mine")
    with pytest.raises(DataError, match="task name 'my task'"):
        parse_task_list(f"my task={tmp_path}")
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match="line 1: a task of your own needs the uniform fields"):
        load_task("odd", odd)
    mixed = write_jsonl(tmp_path / "mixed.jsonl", MC_ROWS + CLOZE_ROWS)
    with pytest.raises(DataError, match="line 3 is a cloze item but the first was multiple-choice"):
        load_task("mixed", mixed)
