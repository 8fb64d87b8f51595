"""``archlab bench``'s shapes fit the model: the README's plain command works on every preset."""

from __future__ import annotations

import argparse

import pytest

from archlab.infer.cli import fit_bench_shapes
from tests.helpers import run_cli


def _args(what: str, steps: int = 100, prompt: int | None = None, context: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(what=what, steps=steps, prompt=prompt, context=context)


@pytest.mark.parametrize("max_len,prompt,context", [
    (4096, 2048, 1024),  # the defaults fit: kept
    (2048, 2048, 1024),
    (1024, 1024, 512),  # the 124m / 20m presets' context
    (256, 256, 128),  # the tiny preset's
])
def test_defaults_fit_the_context(max_len, prompt, context):
    args = _args("all")
    fit_bench_shapes(args, max_len)
    assert (args.prompt, args.context) == (prompt, context)
    assert args.prompt <= max_len and args.context + args.steps + 16 <= max_len


def test_given_shapes_are_kept():
    args = _args("decode", prompt=300, context=900)
    fit_bench_shapes(args, 1024)
    assert (args.prompt, args.context) == (300, 900)  # too long with --steps 100: refused by the caller


def test_the_plain_command_runs_on_a_short_context_and_says_what_it_chose(capsys):
    code, out, err = run_cli(capsys, "bench", "all", "--preset", "tiny", "--device", "cpu", "--steps", "2",
                             "--batches", "1")
    assert code == 0, err  # the tiny preset's context is 256
    assert "archlab: bench: prompt 256 and context 128, to fit the model's context of 256 tokens" in err
    assert "prompt 256, batch 1" in out and "batch 1, context 128" in out
    code, out, err = run_cli(capsys, "bench", "decode", "--preset", "tiny", "--device", "cpu", "--steps", "2",
                             "--batches", "1", "--context", "250")
    assert code == 2 and "need 268 positions; the model has 256" in err and err.count("\n") == 1
