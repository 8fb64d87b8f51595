"""Sharded checkpoints of distributed runs (torch.distributed.checkpoint, DCP).

Layout (``format: "dcp"`` in ``state.json``)::

    run/ckpt/step_000200/dcp/            model weights and AdamW moments, one shard file per rank
                                         (__R_0.distcp) plus DCP's .metadata
                         rng.R.safetensors   each rank's RNG states
                         model.safetensors   the whole model, gathered (final checkpoint only)
                         state.json          config, step, optimizer hyper-parameters, file sizes
                         tokenizer.json

Every rank writes its shards into the same temporary directory (chosen by rank 0), then rank 0
writes ``state.json`` and renames the directory into place, exactly like a one-process
checkpoint (``archlab.io.checkpoint``): a save killed at any moment leaves the previous
checkpoint and ``latest`` intact. Several nodes therefore need a shared file system for the run
directory.

State dicts go through ``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` /
``set_state_dict``): keys are parameter names whatever the wrapping (plain, DDP, FSDP), and DCP
reshards on load, so a checkpoint saved by N processes resumes on M, including M = 1 without a
process group. Only tensors go into DCP; the optimizer's hyper-parameters stay in ``state.json``.

Trust boundary: DCP stores its ``.metadata`` with pickle, and a plain ``pickle.load`` of a
hostile file runs code. ``SafeReader`` unpickles it with an allow-list of DCP's own metadata
dataclasses and torch's dtype/size types, so anything else is refused with one line; shard data
is read with ``torch.load(weights_only=True)`` (DCP's own reader). eval, generate and serve never
read DCP at all: they read ``model.safetensors`` (present in a run's final checkpoint, or written
by ``archlab checkpoint consolidate``). Shard files are checked for presence and size on load
(a truncated copy is caught); unlike the safetensors files they are not hashed, as hashing an
optimizer's worth of shards at every checkpoint of a large run would cost minutes.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)

from archlab.errors import CheckpointError
from archlab.io import checkpoint as ckpt_io
from archlab.io.temporaries import temporary_path

FORMAT = "dcp"


# ---- reading DCP metadata without arbitrary unpickling -------------------------------------------
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                    "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint._extension")
_ALLOWED_TORCH = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." in name:  # protocol 4 resolves dotted names attribute by attribute: x.os.system
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")
        if module in _ALLOWED_MODULES:
            # Only the classes these modules define (metadata dataclasses and enums), never a
            # function or a module they import.
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, _ALLOWED_TORCH):
                return obj
        if module == "torch.serialization" and name == "_get_layout":  # a layout by its name
            return super().find_class(module, name)
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
            return super().find_class(module, name)  # the checkpoint id DCP records: a path, inert
        if module == "builtins" and name in ("set", "frozenset", "slice"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader whose ``.metadata`` is unpickled with an allow-list (see the module
    docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        if hasattr(self, "_get_metadata_path"):  # torch >= 2.12: also per-rank metadata files
            path = self._get_metadata_path(kwargs.get("rank"))
        else:
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            raw = f.read()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as e:
            raise CheckpointError(f"sharded checkpoint {self.path}: unreadable or untrusted .metadata ({e})") from None
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"sharded checkpoint {self.path}: .metadata holds no DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


# ---- the tensors that go into DCP ----------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _tensor_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict, list]:
    """(model state, optimizer tensor state, optimizer param_groups) keyed by parameter names.

    ``get_state_dict`` also creates the optimizer's moments when there are none yet (a zero step
    at learning rate 0), so a fresh run has tensors for DCP to load into."""
    msd, osd = get_state_dict(model, opt)
    return msd, osd["state"], osd["param_groups"]


def is_sharded(state: dict[str, Any]) -> bool:
    return state.get("format") == FORMAT


def save(target: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any],
         extra_files: dict[str, Path], rank: int, world_size: int, tmp_name: str,
         barrier, full_model: bool) -> None:
    """Collective: every rank calls this with the same ``tmp_name`` (rank 0's choice).

    ``full_model`` also gathers the whole model to rank 0 as ``model.safetensors`` (what eval,
    generate and serve read)."""
    target = Path(target)
    tmp = target.parent / tmp_name
    msd, ostate, groups = _tensor_state(model, opt)
    try:
        if rank == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        barrier()
        dcp.save({"model": msd, "optim": ostate}, storage_writer=dcp.FileSystemWriter(str(tmp / "dcp")))
        rng = {"rng.cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["rng.cuda"] = torch.cuda.get_rng_state()
        save_file(rng, str(tmp / f"rng.{rank}.safetensors"))
        full = None
        if full_model:
            # every rank takes part in the gather; only rank 0 receives (cpu_offload)
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        barrier()  # every rank's files are complete
        if rank == 0:
            files = {}
            if full is not None:
                save_file(_dedup(full), str(tmp / "model.safetensors"))
                files["model.safetensors"] = None
            sizes = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted((tmp / "dcp").rglob("*"))
                     if p.is_file()}
            for p in sorted(tmp.glob("rng.*.safetensors")):
                files[p.name] = None
            ckpt_io.finish_build(tmp, list(files), {**state, "format": FORMAT, "world_size": world_size,
                                              "optimizer": {"param_groups": groups}, "dcp_files": sizes},
                                 extra_files)
            ckpt_io.install_built(tmp, target)
    except BaseException:
        if rank == 0:
            ckpt_io.discard(tmp)
        raise
    barrier()  # nobody goes on (and maybe prunes or reads) before the checkpoint is in place


def _dedup(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied tensors once, contiguous (safetensors refuses shared storage), as model_tensors does."""
    out, seen = {}, set()
    for k, v in sd.items():
        if v.data_ptr() in seen and v.numel() > 0:
            continue
        seen.add(v.data_ptr())
        out[k] = v.detach().contiguous().cpu()
    return out


def check_files(ckpt: Path, state: dict[str, Any]) -> None:
    for rel, size in state.get("dcp_files", {}).items():
        p = ckpt / rel
        if not p.is_file():
            raise CheckpointError(f"sharded checkpoint {ckpt} is incomplete: {rel} is missing")
        if p.stat().st_size != size:
            raise CheckpointError(f"sharded checkpoint {ckpt} is damaged: {rel} has {p.stat().st_size} "
                                  f"bytes, {size} were written")


def load(ckpt: Path, state: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer | None,
         rank: int = 0) -> dict[str, torch.Tensor]:
    """Load a sharded checkpoint into ``model`` (plain, DDP or FSDP, any number of processes,
    with or without a process group) and ``opt``; return this rank's RNG tensors."""
    check_files(ckpt, state)
    if opt is not None:
        msd, ostate, _ = _tensor_state(model, opt)
        tree = {"model": msd, "optim": ostate}
    else:
        tree = {"model": get_model_state_dict(model)}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tree, storage_reader=SafeReader(str(ckpt / "dcp")), no_dist=not _distributed())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        # DCP wraps whatever fails in a rank's own part of the load (a shard it cannot read, a
        # shape that does not fit) in a CheckpointException, with every rank's traceback; that
        # class derives from BaseException, hence named here. An error DCP did not wrap comes
        # from one of its collectives: a peer died mid-load, which says nothing against the
        # checkpoint, so it goes up as it is and the caller reports the lost rank.
        if _distributed() and not isinstance(e, CheckpointException):
            raise
        text = str(e)
        ours = re.search(r"(sharded checkpoint \S+: [^\n;]*)", text)
        if ours:
            raise CheckpointError(ours[1]) from None
        last = [line for line in text.strip().splitlines() if line.strip()]
        raise CheckpointError(f"sharded checkpoint {ckpt} does not fit this model or is damaged: "
                              f"{(last[-1] if last else e.__class__.__name__)[:200]}") from None
    if opt is not None:
        set_state_dict(model, opt, model_state_dict=tree["model"],
                       optim_state_dict={"state": tree["optim"], "param_groups": state["optimizer"]["param_groups"]})
    else:
        set_state_dict(model, [], model_state_dict=tree["model"], optim_state_dict={})
    rng_file = ckpt / f"rng.{rank}.safetensors"
    if not rng_file.is_file():  # more ranks now than when saved: rank 0's states
        rng_file = ckpt / "rng.0.safetensors"
    return ckpt_io.load_tensors(ckpt, rng_file.name.removesuffix(".safetensors"))


def pick_temporary(target: Path) -> str:
    """A temporary directory name for ``target`` (rank 0's host and pid: stale-temporary
    cleanup removes it once that process is gone)."""
    return temporary_path(Path(target), "tmp").name


__all__ = ["FORMAT", "SafeReader", "is_sharded", "load", "pick_temporary", "save"]
