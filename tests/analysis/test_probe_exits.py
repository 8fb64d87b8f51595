"""``archlab probe exits``: the validation loss at every exit of a tiny trained run, in one run
over the layers per validation batch, each equal to ``archlab eval --exit-layer L``; bad values are
one line and exit code 2."""

from __future__ import annotations

import json

import pytest

from archlab.analysis.exits import exit_losses
from archlab.data.loader import TokenData
from archlab.io.checkpoint import load_model
from tests.helpers import run_cli

WINDOWS = ("--batches", "3", "--batch-size", "2", "--device", "cpu")


def test_every_exit_equals_eval_with_that_exit(tiny_run, capsys):
    code, out, err = run_cli(capsys, "probe", "exits", "--ckpt", str(tiny_run), *WINDOWS, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert [r["exit"] for r in res["exits"]] == [1, 2] and [r["layer"] for r in res["exits"]] == [0, 1]
    for row in res["exits"]:
        code, out, err = run_cli(capsys, "eval", "--ckpt", str(tiny_run), *WINDOWS, "--json",
                                 "--exit-layer", str(row["exit"]))
        ref = json.loads(out)
        assert row["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert row["bpb"] == pytest.approx(ref["bpb"], rel=1e-6)
        assert res["tokens"] == ref["tokens"]
    code, out, err = run_cli(capsys, "probe", "exits", "--ckpt", str(tiny_run), *WINDOWS)
    assert code == 0 and "1/2" in out and "2/2" in out and "+0.0000" in out


def test_one_run_over_the_layers_per_batch(tiny_run):
    model, cfg, _ = load_model(tiny_run)
    calls = []
    real = model.run
    model.run = lambda x, ctx, **kw: calls.append(x.shape) or real(x, ctx, **kw)
    res = exit_losses(model, TokenData(cfg.data.path), 3, 2, 16)
    assert len(calls) == 3 and len(res["exits"]) == 2 and res["tokens"] == 3 * 2 * 16


@pytest.mark.parametrize("argv,message", [
    (["--batches", "0"], "argument --batches: must be at least 1"),
    (["--seq-len", "100000"], "--seq-len must be at most the model's context"),
])
def test_bad_values_are_one_line_and_exit_2(tiny_run, capsys, argv, message):
    code, out, err = run_cli(capsys, "probe", "exits", "--ckpt", str(tiny_run), "--device", "cpu", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err
