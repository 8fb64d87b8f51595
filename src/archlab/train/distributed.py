"""Training on several processes: the process group, model wrapping, the global batch's slices.

Launched by ``torchrun`` (docs/distributed.md), which sets ``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK`` and the rendezvous address; without it (``WORLD_SIZE`` unset or 1) nothing here is
used and the trainer runs as one process. On CPU the group uses gloo, on CUDA nccl with the
device ``LOCAL_RANK``.

Semantics: ``train.batch_size`` is the *global* batch. Every rank draws the batch the
one-process run draws at that step and keeps its own contiguous slice of rows, so N processes
see exactly the rows one process sees, and the losses match up to the order of float sums.
Gradients are averaged over ranks (DDP's all-reduce or FSDP's reduce-scatter), and the logged
loss and the validation loss are averaged too, so rank 0's logs are those of the global batch.

Layouts (``train.parallel``): ``ddp`` replicates the model (DistributedDataParallel); ``fsdp``
shards parameters, gradients and optimizer state (FSDP2 ``fully_shard``, one unit per sublayer
module of each block, the rest in the root unit), computing in bf16 with fp32 gradient reduction on CUDA and in fp32
on CPU. ``none`` under torchrun means ddp: a launch of several processes wants data parallelism,
and failing would only make the user type the obvious choice.

Failure: a rank that raises prints its error (prefixed with its rank) and exits non-zero;
torchrun then stops the others, and a rank that notices first (a collective whose peer is gone)
exits with one line saying so. ``train.dist_timeout_s`` bounds every collective, so a rank whose
peer hangs rather than dies fails too.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from archlab.errors import ArchlabError, ConfigError
from archlab.model.core import parallel


class DistributedError(ArchlabError):
    """Another rank of a distributed run failed or cannot be reached."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    parallel: str  # ddp | fsdp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- the global batch ------------------------------------------------------------------
    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of a global batch's rows (the batch divides evenly:
        ``setup`` checked)."""
        n = t.shape[0] // self.world_size
        return t[self.rank * n:(self.rank + 1) * n]

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` averaged over the ranks (every rank gets the result). SUM then divide: gloo has
        no AVG."""
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t / self.world_size

    def sum(self, values: list[float]) -> list[float]:
        """``values`` added over the ranks, in float64 (counts stay exact up to 2**53)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def barrier(self) -> None:
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def broadcast_text(self, text: str) -> str:
        """Rank 0's ``text`` on every rank (as bytes in a tensor: no pickled objects)."""
        data = torch.tensor(list(text.encode()) if self.is_main else [], dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=0)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.is_main:
            buf.copy_(data)
        dist.broadcast(buf, src=0)
        return bytes(buf.cpu().tolist()).decode()


def world_size_from_env() -> int:
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"config error: WORLD_SIZE={raw!r} is not a number (set by torchrun)") from None


def setup(tc) -> DistEnv | None:
    """Join the process group torchrun described, or None when this is a single process.

    Checks the config against the world size first, so a bad launch fails before any process
    waits for another."""
    world = world_size_from_env()
    if world <= 1:
        return None
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if tc.batch_size % world:
        raise ConfigError(f"config error: train.batch_size={tc.batch_size} is the global batch and must "
                          f"divide evenly over the {world} processes")
    if tc.cuda_graph:
        raise ConfigError("config error: train.cuda_graph does not combine with a distributed run "
                          "(its collectives run outside the graph); leave it off under torchrun")
    want_cuda = tc.device.startswith("cuda") or (tc.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ConfigError("config error: train.device: CUDA was asked for but no CUDA device is available")
    if want_cuda:
        # torchrun's LOCAL_RANK picks the GPU; a train.device of cuda:N would put ranks together
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=tc.dist_timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if want_cuda else "gloo", timeout=timeout,
                                device_id=device if want_cuda else None)
    parallel.set_data_parallel_group(dist.group.WORLD)
    _stop_quietly_on_sigterm(rank)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device,
                   parallel="ddp" if tc.parallel == "none" else tc.parallel)


def teardown(env: DistEnv | None) -> None:
    parallel.set_data_parallel_group(None)
    if env is not None and dist.is_initialized():
        dist.destroy_process_group()


def _stop_quietly_on_sigterm(rank: int) -> None:
    """torchrun stops the surviving ranks with SIGTERM when one fails: say so in one line
    instead of dying silently (or with a traceback from wherever the signal landed)."""
    def handler(signum, frame):  # noqa: ARG001
        print(f"archlab: rank {rank}: stopped by torchrun because another rank failed "
              "(its error is above)", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def rank_error(env: DistEnv, e: BaseException) -> BaseException:
    """The exception a rank leaves with: an ArchlabError keeps its type with the rank in front;
    a failed collective (a peer gone or timed out) becomes one DistributedError line.

    From here on the rank ignores torchrun's SIGTERM: it is leaving with its own error line
    already, and a second line ("stopped by torchrun") would only blur which one to read."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if isinstance(e, ArchlabError):
        return type(e)(f"rank {env.rank}: {e}")
    if isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and _looks_like_lost_peer(e)):
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else e.__class__.__name__
        return DistributedError(f"rank {env.rank}: lost contact with another rank of the run (it "
                                f"probably failed: see its error; the last checkpoint is kept): {first}")
    return e


def _looks_like_lost_peer(e: RuntimeError) -> bool:
    text = str(e).lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "timed out",
                                   "gloo", "nccl", "socket", "peer"))


# ---- wrapping the model -------------------------------------------------------------------------
def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (``Transformer.layers``)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no .layers ModuleList to shard block by block")
    return list(layers)


def _wrap_entry_points(block: nn.Module, wrapper) -> None:
    """Replace each entry point the decoder calls on ``block`` (``Block.ENTRY_POINTS``) with
    ``wrapper(bound_method)``, on the instance."""
    for name in block.ENTRY_POINTS:
        setattr(block, name, wrapper(getattr(block, name)))


def _checkpointed(fn):
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(fn)
    def run(*args, **kwargs):
        # Non-reentrant: the blocks take a Context (not a tensor) and record into it.
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return run


def prepare_blocks(model: nn.Module, tc) -> None:
    """Per-block compilation and activation checkpointing (each wraps the block's entry points;
    the checkpoint goes outside the compiled code, so the recompute runs the compiled code)."""
    for block in blocks(model):
        if tc.compile:
            _wrap_entry_points(block, torch.compile)
        if tc.activation_checkpointing:
            _wrap_entry_points(block, _checkpointed)


def wrap(model: nn.Module, tc, env: DistEnv) -> nn.Module:
    """``model`` (on ``env.device``) laid out over the ranks; build the optimizer on the result."""
    if env.parallel == "ddp":
        prepare_blocks(model, tc)
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [env.device.index] if env.device.type == "cuda" else None
        # Broadcasting rank 0's weights at construction makes a resumed or freshly seeded model
        # identical everywhere even if a rank's initialisation differed.
        return DDP(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    if env.device.type == "cuda" and tc.dtype != "float32":
        # bf16 compute like the one-process run's autocast; gradients reduced in fp32
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()  # fp32 on CPU/gloo (and when train.dtype=float32)
    # Units per sublayer, not per block: the decoder calls a block's attention and FFN
    # separately (Block.ENTRY_POINTS), never block.forward, so a block-wide unit would be
    # gathered twice per pass; each sublayer module is gathered exactly once per call.
    # Compilation is per unit, before sharding (FSDP's hooks stay outside the compiled code);
    # activation checkpointing wraps the block's entry points, around the units.
    prepare_blocks(model, dataclasses.replace(tc, compile=False))
    for block in blocks(model):
        for name in block.SHARD_UNITS:
            unit = getattr(block, name)
            if tc.compile:
                unit.compile()
            fully_shard(unit, mesh=mesh, mp_policy=mp)
    # The root unit: embeddings, head (tied to the embedding or not), final norm, and the
    # variants' parameters outside the blocks (AttnRes queries, branch tables).
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose parameter names are the checkpoint's (DDP adds ``module.``)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model


def load_full_state(model: torch.nn.Module, opt: torch.optim.Optimizer,
                    model_tensors: dict[str, torch.Tensor], optim_tensors: dict[str, torch.Tensor],
                    param_groups: list[dict[str, Any]]) -> None:
    """Load a one-process (safetensors) checkpoint's full tensors into a wrapped model and its
    optimizer (every rank passes the same full tensors; FSDP keeps its shard of each).

    The safetensors format numbers optimizer states by parameter position (``state.I.K``); they
    are renamed to parameter names here through the optimizer's own parameter order."""
    inner = unwrap(model)
    names: dict[int, str] = {}
    for name, p in inner.named_parameters():  # tied parameters: the first name, as get_state_dict
        names.setdefault(id(p), name)
    full_msd = dict(model_tensors)
    by_param: dict[int, str] = {}
    for name, p in inner.named_parameters(remove_duplicate=False):  # tied names stored once
        key = by_param.setdefault(id(p), name)
        if name not in full_msd and key in full_msd:
            full_msd[name] = full_msd[key]
    state: dict[str, dict[str, torch.Tensor]] = {}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    for key, v in optim_tensors.items():
        if key.startswith("state."):
            _, idx, k = key.split(".", 2)
            state.setdefault(order[int(idx)], {})[k] = v
    groups, start = [], 0
    for g in param_groups:
        n = len(g["params"])
        groups.append({**g, "params": order[start:start + n]})
        start += n
    set_state_dict(model, opt, model_state_dict=full_msd, optim_state_dict={"state": state, "param_groups": groups},
                   options=StateDictOptions(full_state_dict=True))
