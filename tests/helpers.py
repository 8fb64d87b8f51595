"""Small helpers shared by tests (imported as ``tests.helpers``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


def tiny_model_cfg(**over):
    """A model small enough for exact float checks in milliseconds."""
    from archlab.model.config import ModelConfig

    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    base.update(over)
    cfg = ModelConfig(**base)
    cfg.validate()
    return cfg


def slow_down(engine, step_s: float):
    """``engine`` with every decode step taking at least ``step_s`` longer: a slow accelerator,
    which the engine thread waits for without the GIL, so requests overlap as on a busy server."""
    import time

    step = engine.step

    def slow_step(greedy: bool = False, penalised: bool = False):
        time.sleep(step_s)
        return step(greedy, penalised)

    engine.step = slow_step
    return engine


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``archlab ARGV`` in-process: (exit code, stdout, stderr); argparse's exits count too."""
    from archlab.cli import main

    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


@contextlib.contextmanager
def small_filesystem(path: Path, size_kb: int) -> Iterator[Path]:
    """A real file system of ``size_kb`` KB (tmpfs) mounted at ``path`` for the block, so a full
    disk is the kernel's ENOSPC, not a simulated one. Mounting needs root (CAP_SYS_ADMIN); where
    this machine allows none the test is skipped, and the simulated-ENOSPC tests cover the path."""
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if os.geteuid() != 0 or mount is None or umount is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8); the simulated ENOSPC tests cover this")
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([mount, "-t", "tmpfs", "-o", f"size={size_kb}k,mode=0755", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip()}); the simulated ENOSPC tests "
                    f"cover this")
    try:
        yield path
    finally:
        subprocess.run([umount, "-l", str(path)], capture_output=True)


def assert_same_function_bitwise(a, b, x) -> None:
    """Models ``a`` and ``b`` give the same logits and the same gradients, bit for bit, on tokens
    ``x`` [B, T+1] (inputs ``x[:, :-1]``, targets ``x[:, 1:]``); both are left with gradients."""
    import torch

    out_a, out_b = a(x[:, :-1], x[:, 1:]), b(x[:, :-1], x[:, 1:])
    assert torch.equal(out_a.logits, out_b.logits)
    out_a.loss.backward()
    out_b.loss.backward()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def assert_config_refused(build, overrides, start: str) -> None:
    """``build(*overrides)`` raises one ``config error:`` line starting with ``start`` (what the
    CLI prints for a bad option, exit code 2)."""
    from archlab.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        build(*overrides)
    message = str(e.value)
    assert "\n" not in message and message.startswith("config error: " + start), message
