"""Loss and bits per byte of a checkpoint on a corpus it never saw: ``archlab data prepare
--tokenizer RUN``, ``archlab eval --ckpt RUN --data OTHER`` and ``evaluate_checkpoint_on``.

The other corpus is real English: the Python reference manual's help topics that the standard
library ships (``pydoc_data.topics``); the run (``tiny_run``) was trained on stdlib source.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from archlab.data import prepare
from archlab.data.loader import TokenData
from archlab.errors import DataError
from archlab.eval.corpus import evaluate_checkpoint_on
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def manual_folder(tmp_path_factory) -> Path:
    from pydoc_data.topics import topics

    folder = tmp_path_factory.mktemp("manual") / "src"
    folder.mkdir()
    for name in sorted(topics)[:40]:  # about 200 KB
        (folder / f"{name}.txt").write_text(topics[name])
    return folder


@pytest.fixture(scope="module")
def other(tiny_run, manual_folder, tmp_path_factory) -> Path:
    """The manual, prepared with the run's own tokenizer through the CLI."""
    from archlab.cli import main

    out = tmp_path_factory.mktemp("other") / "manual"
    assert main(["data", "prepare", "--source", str(manual_folder), "--out", str(out), "--tokenizer",
                 str(tiny_run), "--val-frac", "0.1"]) == 0
    return out


def _by_hand(ckpt_dir: Path, data_dir: Path, batches: int, batch_size: int, seq_len: int):
    """Loss summed with F.cross_entropy over every target, bytes from the decoded target text."""
    from archlab.io.checkpoint import load_model

    model, _, _ = load_model(ckpt_dir)
    model.eval()
    data = TokenData(data_dir)
    nats, targets = 0.0, []
    with torch.no_grad():
        for x, y in data.val_batches(batches, batch_size, seq_len):
            logits = model(x).logits
            nats += float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum"))
            targets.append(y.flatten())
    ids = torch.cat(targets)
    return nats, ids, data


def test_checkpoint_on_another_corpus_matches_the_python_api(tiny_run, other, capsys) -> None:
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(tiny_run), "--data", str(other), "--batches", "3",
                             "--batch-size", "4", "--json")
    assert code == 0, err
    cli = json.loads(out)
    api = evaluate_checkpoint_on(other, tiny_run, batches=3, batch_size=4)
    assert cli == api
    assert api["tokens"] == api["tokens_requested"] == 3 * 4 * 32  # the run's seq_len
    nats, ids, data = _by_hand(Path(api["checkpoint"]), other, 3, 4, 32)
    assert api["loss"] == pytest.approx(nats / len(ids), rel=1e-5)
    # bits per byte over the bytes of exactly these targets, not the split's average
    text = data.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
    if "\ufffd" not in text:  # windows may end inside a multi-byte character
        assert api["bytes"] == len(text.encode("utf-8"))
    assert api["bytes"] == int(data.token_bytes[ids.numpy()].sum())
    assert api["bpb"] == pytest.approx(nats / math.log(2) / api["bytes"], rel=1e-5)
    assert api["bytes"] != round(api["tokens"] * data.bytes_per_token("val"))
    # the manifest says where the tokenizer came from, and it is the checkpoint's, byte for byte
    manifest = json.loads((other / "manifest.json").read_text())
    assert manifest["tokenizer"]["reused_from"] == str((Path(api["checkpoint"]) / "tokenizer.json").resolve())
    assert (other / "tokenizer.json").read_bytes() == (Path(api["checkpoint"]) / "tokenizer.json").read_bytes()


def test_a_data_dir_lends_its_tokenizer_too(stdlib_data, manual_folder, tmp_path) -> None:
    m = prepare(str(manual_folder), tmp_path / "out", tokenizer=stdlib_data, val_frac=0.1)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (stdlib_data / "tokenizer.json").read_bytes()
    assert m["vocab_size"] == 512 and m["tokenizer"]["reused_from"] == str((stdlib_data / "tokenizer.json").resolve())
    with pytest.raises(DataError, match="--vocab-size applies to a tokenizer trained here"):
        prepare(str(manual_folder), tmp_path / "out2", tokenizer=stdlib_data, vocab_size=300)
    with pytest.raises(DataError, match="neither prepared data .* nor a run or checkpoint directory"):
        prepare(str(manual_folder), tmp_path / "out2", tokenizer=manual_folder)
    assert not (tmp_path / "out2").exists()


def test_a_mismatched_tokenizer_is_one_line(tiny_run, manual_folder, tmp_path) -> None:
    own = tmp_path / "own"
    prepare(str(manual_folder), own, vocab_size=300, val_frac=0.1)
    with pytest.raises(DataError, match=r"another tokenizer than checkpoint .*--tokenizer") as e:
        evaluate_checkpoint_on(own, tiny_run, batches=1, batch_size=1)
    assert "\n" not in str(e.value)


def test_evaluation_past_the_end_of_the_split_does_not_wrap(tiny_run, other, capsys) -> None:
    data = TokenData(other)
    n_val = data.n_tokens("val")
    many = n_val // (8 * 32) + 5  # batches of 8 x 32 targets: more than the split holds
    api = evaluate_checkpoint_on(other, tiny_run, batches=many, batch_size=8)
    assert api["tokens"] == (n_val - 1) // 32 * 32 < api["tokens_requested"]
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(tiny_run), "--data", str(other), "--batches",
                             str(many))
    assert code == 0, err
    assert f"over {api['tokens']:,} tokens" in out and "none wrapped" in err


def test_the_trainer_logs_the_tokens_it_scored(stdlib_data, tmp_path, capsys) -> None:
    """train.eval_batches past the end of the val split: scored once to its end, logged and said."""
    from tests.conftest import small_config
    from archlab.train.trainer import read_curves, train

    n_val = TokenData(stdlib_data).n_tokens("val")
    many = n_val // (4 * 32) + 3
    res = train(small_config(stdlib_data, "train.steps=2", "train.eval_every=2", "train.ckpt_every=2",
                             f"train.eval_batches={many}"), tmp_path / "run", show_progress=False)
    _, val = read_curves(tmp_path / "run")
    assert val[-1]["val_tokens"] == (n_val - 1) // 32 * 32 < many * 4 * 32
    assert "fewer tokens than the" in capsys.readouterr().err  # said once, on stderr
    assert res.final_val_bpb == val[-1]["bpb"]
    api = evaluate_checkpoint_on(stdlib_data, tmp_path / "run", batches=many, batch_size=4)
    assert api["loss"] == pytest.approx(val[-1]["loss"], rel=1e-5) and api["tokens"] == val[-1]["val_tokens"]
