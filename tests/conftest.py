"""Shared fixtures: a small real corpus (the interpreter's stdlib sources), prepared once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels are tested in Triton's CPU interpreter. Triton reads this when it
# is first imported (importing torch does not import it; torch.compile does), so it is set here,
# before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests are small; more threads than cores only slows a 2-core CI machine down.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True, scope="session")
def sigint_raises_keyboard_interrupt():
    """Several tests send themselves SIGINT to stand for Ctrl-C. A shell without job control
    starts a background command (``pytest &`` in a script) with SIGINT ignored, and Python then
    keeps it ignored, so those tests would test nothing; give them the interpreter's usual handler."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    if before is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory) -> Path:
    """About 600 KB of real Python source, byte-level BPE with 512 tokens."""
    from archlab.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare("stdlib", out, vocab_size=512, max_bytes=600_000)
    return out


SMALL = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "train.batch_size=4", "train.seq_len=32", "train.warmup_steps=2", "train.eval_batches=2"]


def small_config(data: Path, *extra: str):
    """A seconds-long training config on the prepared fixture corpus."""
    from archlab.config import make_config

    return make_config("tiny", overrides=[*SMALL, f"data.path={data}", *extra])


@pytest.fixture(scope="session")
def tiny_run(stdlib_data, tmp_path_factory) -> Path:
    """A finished 6-step run directory (checkpoints at steps 3 and 6)."""
    from archlab.train.trainer import train

    out = tmp_path_factory.mktemp("runs") / "tiny"
    train(small_config(stdlib_data, "train.steps=6", "train.ckpt_every=3", "train.eval_every=3"), out,
          show_progress=False)
    return out
