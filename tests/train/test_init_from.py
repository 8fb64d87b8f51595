"""``train.init_from`` / ``archlab train --init-from``: a new run starts from another checkpoint's
weights (a converted model's, for continued pretraining), with a fresh optimizer and schedule."""

from __future__ import annotations

import json

import torch

from archlab.config import make_config
from archlab.convert.delta import convert_checkpoint
from archlab.io import checkpoint as ckpt_io
from archlab.train.trainer import Run
from tests.conftest import SMALL
from tests.helpers import run_cli


def _sets(data, *extra: str) -> list[str]:
    return [a for o in [*SMALL, f"data.path={data}", *extra] for a in ("--set", o)]


def _first_train_loss(run_dir) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in records if r["kind"] == "train")


def test_a_converted_model_trains_on_from_its_weights(stdlib_data, tiny_run, tmp_path, capsys):
    """The delta-MHAR conversion of a trained run, trained on with --init-from: the model section
    is the conversion's, the starting weights are exactly its, and the first step's loss is the
    original run's loss on that batch (the conversion keeps the function), far below a fresh
    model's."""
    converted = tmp_path / "delta"
    convert_checkpoint(tiny_run, converted, heads=2)
    out = tmp_path / "continued"
    argv = ["train", "--preset", "tiny", *_sets(stdlib_data, "train.steps=2", "train.log_every=1"),
            "--init-from", str(converted), "--out", str(out)]
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert f"starting from the weights of {converted} (train.init_from)" in err
    cfg = make_config("tiny", overrides=[*SMALL, f"data.path={stdlib_data}"])
    saved = ckpt_io.read_state(ckpt_io.resolve_checkpoint(out))["config"]
    assert saved["train"]["init_from"] == str(converted)
    assert saved["model"] == ckpt_io.read_state(converted)["config"]["model"] != cfg.model.to_dict()

    # the weights a new run starts from are the checkpoint's, bit for bit
    run = Run(make_config("tiny", files=[out / "config.yaml"]), tmp_path / "fresh")
    want = ckpt_io.load_tensors(converted, "model")
    got = ckpt_io.model_tensors(run.model)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    fresh = tmp_path / "fresh-run"
    code, _, err = run_cli(capsys, "train", "--preset", "tiny", *_sets(stdlib_data, "train.steps=2", "train.log_every=1"),
                           "--out", str(fresh))
    assert code == 0, err
    assert _first_train_loss(out) < _first_train_loss(fresh) - 0.2  # observed 5.91 against 6.25

    # the same command again resumes the run (its own checkpoint), not the initialisation
    code, _, err = run_cli(capsys, *argv)
    assert code == 0 and f"resuming from step 2 of {out}" in err and "starting from the weights" not in err


def test_weights_of_another_shape_or_no_checkpoint_are_one_line(stdlib_data, tiny_run, tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", "--preset", "tiny", *_sets(stdlib_data, "train.steps=2",
                                                                        "model.d_model=64"),
                           "--init-from", str(tiny_run), "--out", str(tmp_path / "wider"))
    assert code == 1 and err.count("\n") == 1 and "has shape" in err and "the model expects" in err, err
    assert not (tmp_path / "wider").exists()
    code, _, err = run_cli(capsys, "train", "--preset", "tiny", *_sets(stdlib_data),
                           "--init-from", str(tmp_path / "nothing"), "--out", str(tmp_path / "x"))
    assert code == 1 and err.count("\n") == 1 and "no checkpoint with a model config" in err, err
    assert not (tmp_path / "x").exists()
