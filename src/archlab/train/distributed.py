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
exits with one line saying so. A rank that dies without a word (``kill -9``, the out-of-memory
killer, a crash) is noticed within about a second either way: the kernel closes its
connections, so a peer's gloo collective fails at once, and torchrun sees the exit and sends
the others SIGTERM (a rank blocked waiting for its GPU handles it once it is back in Python;
torchrun kills it 30 s later if it never is). Neither says *which* rank died, nor whether a
peer that is gone was killed, failed with its own error line or was stopped by torchrun:
``Roster`` keeps what a survivor needs to tell them apart and name the rank that died.
``train.dist_timeout_s`` bounds every collective, so a rank whose peer hangs rather than dies
(or whose host vanishes without closing its connections) fails too.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import signal
import sys
import time
from dataclasses import dataclass, field
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
    roster: Roster = field(compare=False, repr=False)  # the other ranks, for the line a failure leaves

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
    env = DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device,
                  parallel="ddp" if tc.parallel == "none" else tc.parallel,
                  roster=Roster.gather(rank, world, device))
    _stop_quietly_on_sigterm(env)
    return env


def teardown(env: DistEnv | None) -> None:
    parallel.set_data_parallel_group(None)
    if env is not None and dist.is_initialized():
        dist.destroy_process_group()


# ---- when a rank is gone ------------------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    """Another rank of the run: its process id, and whether this rank can watch that process
    (both were started by the same torchrun agent: one host, one process-id namespace)."""
    rank: int
    pid: int
    same_host: bool


# Why a rank left, as it records it just before it exits (``Roster.record``).
FAILED = "failed"  # its own error line (or traceback) is above
LEFT = "left"  # another rank failed or torchrun stopped the job; its line says so
UNKNOWN = "unknown"  # (read back only) no store to ask: whether it said anything is not known


class Roster:
    """The other ranks as this one knows them, for the line it leaves with when one is gone.

    A peer can be gone three ways: it failed and printed its error, it left because of another
    rank (torchrun stopped it, or its collective lost a peer), or it died without a word
    (SIGKILL, the out-of-memory killer, a crash). Only the last needs a survivor to name it, and
    the process alone cannot tell them apart: when torchrun stops the whole job, a rank blocked
    in a collective sees its peer's process end a moment before its own SIGTERM is handled,
    exactly as if the peer had been killed. So every rank that leaves on its own records why in
    torchrun's store (a key per rank; the store lives in torchrun's agent, not in any rank)
    before it exits, and a peer whose process ended without a record is the one that died.

    Only peers on this host can be watched (their process ids are swapped at setup); a rank on
    another host is never named, and its survivors fall back to the collective's own error."""

    def __init__(self, rank: int, peers: tuple[Peer, ...], store: dist.Store | None):
        self.rank, self.peers, self.store = rank, peers, store

    @classmethod
    def gather(cls, rank: int, world: int, device: torch.device) -> Roster:
        """Collective: every rank's process id and agent, then a connection to the store."""
        agent = os.environ.get("GROUP_RANK", "")  # torchrun's number for the agent that started us
        mine = torch.tensor([os.getpid(), int(agent) if agent.isdigit() else -1], dtype=torch.int64,
                            device=device)
        table = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(table, mine)
        peers = tuple(Peer(rank=r, pid=int(row[0]), same_host=agent.isdigit() and int(row[1]) == int(agent))
                      for r, row in enumerate(table) if r != rank)
        return cls(rank, peers, _store_client())

    def record(self, why: str) -> None:
        """Say why this rank leaves (``FAILED`` or ``LEFT``), before its process ends."""
        if self.store is None:
            return
        try:
            self.store.set(str(self.rank), why)
        except RuntimeError:  # the store's host is gone too: the line is printed all the same
            pass

    def ended(self, wait_s: float) -> dict[int, str | None]:
        """{rank: why it left, None when it recorded nothing} for the peers of this host whose
        process has ended, waiting up to ``wait_s`` for one to show.

        The wait is for the race this is called in: a dead peer's connections close while the
        kernel tears the process down, so the collective that noticed may fail an instant before
        the process counts as ended."""
        watched = [p for p in self.peers if p.same_host]
        deadline = time.monotonic() + wait_s
        while True:
            gone = [p.rank for p in watched if _process_ended(p.pid)]
            if gone or not watched or time.monotonic() >= deadline:
                return {r: self._recorded(r) for r in gone}
            time.sleep(0.05)

    def _recorded(self, rank: int) -> str | None:
        if self.store is None:
            return UNKNOWN
        try:
            return self.store.get(str(rank)).decode() if self.store.check([str(rank)]) else None
        except RuntimeError:
            return UNKNOWN

    def pid(self, rank: int) -> int:
        return next(p.pid for p in self.peers if p.rank == rank)


def _store_client() -> dist.Store | None:
    """A client of the store torchrun's agent serves to its ranks (``MASTER_ADDR``/``PORT``),
    under a prefix of this launch (a restarted group starts with a clean slate), or None when
    there is none to reach. Short timeouts: it is only used by a rank on its way out."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not host or not port.isdigit():
        return None  # no agent's store: one served by rank 0 would die with it
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=2))
    except RuntimeError:
        return None
    launch = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"archlab/departures/{launch}/", store)


def _process_ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie that torchrun has not reaped yet
    (on Linux a zombie still answers ``kill(pid, 0)``, so /proc is read where there is one)."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            return True
        # the state letter follows the command name in parentheses (which may hold ") " itself)
        return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] in (b"Z", b"X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's: not a peer, but not ended either
        return False
    return False


def _blame(env: DistEnv, gone: dict[int, str | None]) -> str | None:
    """The line naming the peer that ended the run among ``gone`` (``Roster.ended``): one that
    died without a word first, then one that failed; None when every one of them left because
    of another rank (or of torchrun)."""
    def who(ranks: list[int]) -> str:
        return " and ".join(f"rank {r} (pid {env.roster.pid(r)})" for r in ranks)

    after = "the last checkpoint is kept: run the same command again to resume"
    died = [r for r, why in gone.items() if why is None]
    if died:
        return (f"rank {env.rank}: lost contact with another rank of the run: {who(died)} died without a "
                f"word (killed: kill -9, the out-of-memory killer, or a crash); {after}")
    unsure = [r for r, why in gone.items() if why == UNKNOWN]
    if unsure:
        return (f"rank {env.rank}: lost contact with another rank of the run: {who(unsure)} ended mid-run "
                f"(with no error line of its own above, it was killed: kill -9, the out-of-memory killer, "
                f"or a crash); {after}")
    failed = [r for r, why in gone.items() if why == FAILED]
    if failed:
        ranks = " and ".join(f"rank {r}" for r in failed)
        return f"rank {env.rank}: stopped because {ranks} failed (its error is above); the last checkpoint is kept"
    return None


def _stopped_line(env: DistEnv) -> str:
    return (f"rank {env.rank}: stopped by torchrun (another rank failed, or the job itself was stopped); "
            "the last checkpoint is kept")


def _stop_quietly_on_sigterm(env: DistEnv) -> None:
    """torchrun stops the surviving ranks with SIGTERM when one fails (and every rank when the
    job itself is stopped): say so in one line instead of dying silently (or with a traceback
    from wherever the signal landed), naming the rank that died when it is one of this host's.
    torchrun reaps the failed rank before it signals the others, so it is already gone here."""
    def handler(signum, frame):  # noqa: ARG001
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one line, even if torchrun signals again
        env.roster.record(LEFT)
        line = _blame(env, env.roster.ended(wait_s=0.2)) or _stopped_line(env)
        # one write: the other ranks may be writing their lines to the same terminal right now
        sys.stderr.write(f"archlab: {line}\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def rank_error(env: DistEnv, e: BaseException) -> BaseException:
    """The exception a rank leaves with: an ArchlabError keeps its type with the rank in front;
    a failed collective (a peer gone or timed out) becomes one DistributedError line, naming the
    rank that died when it ran on this host. Either way the rank records why it leaves first
    (``Roster``), so that its peers do not take it for the one that died.

    From here on the rank ignores torchrun's SIGTERM: it is leaving with its own error line
    already, and a second line ("stopped by torchrun") would only blur which one to read."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if isinstance(e, ArchlabError):
        env.roster.record(FAILED)
        return type(e)(f"rank {env.rank}: {e}")
    if isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and _looks_like_lost_peer(e)):
        env.roster.record(LEFT)
        gone = env.roster.ended(wait_s=1.0)
        line = _blame(env, gone)
        if line is None and gone:  # every peer that ended was stopped by torchrun, as this one is
            line = _stopped_line(env)
        if line is not None:
            return DistributedError(line)
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else e.__class__.__name__
        why = ("no answer within train.dist_timeout_s: a rank hangs, or its host is unreachable"
               if "timed out" in first.lower() else "it probably failed: see its error")
        return DistributedError(f"rank {env.rank}: lost contact with another rank of the run ({why}; the last "
                                f"checkpoint is kept): {first}")
    # a bug's traceback is above; an interrupt stops every rank alike
    env.roster.record(LEFT if isinstance(e, KeyboardInterrupt) else FAILED)
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
