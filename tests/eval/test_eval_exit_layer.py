"""``archlab eval --exit-layer L``: the validation loss of an early exit on a tiny trained run;
the last layer is the plain evaluation; bad values are one line and exit code 2."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli


def eval_json(capsys, run, *extra: str) -> dict:
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(run), "--batches", "2", "--batch-size", "2", "--json",
                             "--device", "cpu", *extra)
    assert code == 0, err
    return json.loads(out)


def test_an_exit_after_the_last_layer_is_the_plain_evaluation(tiny_run, capsys):
    full = eval_json(capsys, tiny_run)
    first, last = eval_json(capsys, tiny_run, "--exit-layer", "1"), eval_json(capsys, tiny_run, "--exit-layer", "2")
    assert full["exit_layer"] is None and first["exit_layer"] == 1 and last["exit_layer"] == 2
    assert last["loss"] == full["loss"] and last["bpb"] == full["bpb"]
    assert first["loss"] != full["loss"] and first["tokens"] == full["tokens"]
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(tiny_run), "--batches", "2", "--batch-size", "2",
                             "--exit-layer", "1", "--device", "cpu")
    assert code == 0 and "exit after layer visit 1" in out and f"loss {first['loss']:.4f}" in out


@pytest.mark.parametrize("argv,message", [
    (["--exit-layer", "0"], "argument --exit-layer: must be at least 1"),
    (["--exit-layer", "x"], "argument --exit-layer: must be at least 1"),
    (["--exit-layer", "3"], "--exit-layer must be from 1 to the 2 layer visits the model runs per token, got 3"),
    (["--exit-layer", "1", "--tasks", "piqa"], "--exit-layer applies to the validation loss, not to --tasks"),
])
def test_bad_exit_layers_are_one_line_and_exit_2(tiny_run, capsys, argv, message):
    code, out, err = run_cli(capsys, "eval", "--ckpt", str(tiny_run), "--device", "cpu", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err
