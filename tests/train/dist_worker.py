"""A torchrun entry for the distributed tests: ``archlab ARGS`` with test hooks.

Hooks, chosen by environment variables (the product has none of them):

- ``ARCHLAB_TEST_KILL=R:S``: rank R kills itself with SIGKILL as it starts step S (a real,
  unannounced death: no exception, no cleanup);
- ``ARCHLAB_TEST_FAIL=R:S``: rank R raises an ArchlabError at step S;
- ``ARCHLAB_TEST_HANG=R:S``: rank R stops at step S and waits forever (alive, never joining
  the next collective);
- ``ARCHLAB_TEST_DUMP=PREFIX``: the whole model and optimizer state, gathered from the ranks
  (``get_state_dict(full_state_dict=True)``, not through the checkpoint files), written by rank 0
  to ``PREFIX.resume.safetensors`` right after resuming and ``PREFIX.final.safetensors`` after
  the last checkpoint: the reference the checkpoint files are compared with.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from archlab.cli import main
from archlab.errors import DataError
from archlab.train import trainer


def flat_state(model, opt, options=None) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors by parameter name, each its own copy (tied ones too)."""
    msd, osd = get_state_dict(model, opt, options=options)
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in msd.items()}
    for name, st in osd.get("state", {}).items():  # empty off rank 0 with cpu_offload
        for k, v in st.items():
            out[f"optim.{name}.{k}"] = v.detach().cpu().clone().reshape(v.shape)
    return out


def _hook(var: str) -> tuple[int, int] | None:
    raw = os.environ.get(var)
    if not raw:
        return None
    rank, step = raw.split(":")
    return int(rank), int(step)


def _dump(run, tag: str) -> None:
    prefix = os.environ.get("ARCHLAB_TEST_DUMP")
    if not prefix:
        return
    state = flat_state(run.model, run.opt, StateDictOptions(full_state_dict=True, cpu_offload=True))
    if run.is_main:
        save_file(state, f"{prefix}.{tag}.safetensors")


def _install_hooks() -> None:
    kill, fail, hang = _hook("ARCHLAB_TEST_KILL"), _hook("ARCHLAB_TEST_FAIL"), _hook("ARCHLAB_TEST_HANG")
    step_fn, resume_fn, save_fn = trainer.Run.train_step, trainer.Run.try_resume, trainer.Run.save

    def train_step(self, step):
        if kill == (self.dist.rank, step):
            os.kill(os.getpid(), signal.SIGKILL)
        if hang == (self.dist.rank, step):
            while True:
                time.sleep(1)
        if fail == (self.dist.rank, step):
            raise DataError(f"test hook: rank {self.dist.rank} cannot go on at step {step}")
        return step_fn(self, step)

    def try_resume(self):
        resumed = resume_fn(self)
        _dump(self, "resume")
        return resumed

    def save(self, step):
        save_fn(self, step)
        if step == self.cfg.train.steps:
            _dump(self, "final")

    trainer.Run.train_step, trainer.Run.try_resume, trainer.Run.save = train_step, try_resume, save


if __name__ == "__main__":
    _install_hooks()
    sys.exit(main(sys.argv[1:]))
