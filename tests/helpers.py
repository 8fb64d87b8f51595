"""Small helpers shared by tests (imported as ``tests.helpers``)."""

from __future__ import annotations


def tiny_model_cfg(**over):
    """A model small enough for exact float checks in milliseconds."""
    from archlab.model.config import ModelConfig

    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    base.update(over)
    cfg = ModelConfig(**base)
    cfg.validate()
    return cfg


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``archlab ARGV`` in-process: (exit code, stdout, stderr); argparse's exits count too."""
    from archlab.cli import main

    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err
