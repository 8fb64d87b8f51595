"""Checkpoints: safetensors weights plus JSON state, written atomically, loaded without pickle.

Layout of a run directory::

    run/ckpt/step_000200/model.safetensors   weights
                         optim.safetensors   AdamW moments and step counts, RNG states
                         state.json          config, step, optimizer hyper-parameters, checksums
                         tokenizer.json      copied from the data, so the checkpoint is self-contained
    run/ckpt/latest                          name of the newest complete checkpoint

A checkpoint directory is built under a temporary name, every file fsync'ed, then renamed into
place, and only then is ``latest`` replaced (itself via a temporary file + rename). A crash at any
moment leaves the previous checkpoint and ``latest`` intact. Loading verifies the sha256 of every
file named in ``state.json`` so that truncation or corruption is reported, never silently used.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from archlab.config import RunConfig, config_from_dict
from archlab.data.tokenizer import file_sha256
from archlab.errors import ArchlabError, CheckpointError

FORMAT_VERSION = 1


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors stored once (safetensors refuses shared storage)."""
    sd = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for k, v in sd.items():
        ptr = v.data_ptr()
        if ptr in seen and v.numel() > 0:
            continue
        seen[ptr] = k
        out[k] = v.detach().contiguous().cpu()
    return out


def write_checkpoint(target: Path, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
                     extra_files: dict[str, Path] | None = None) -> Path:
    """Write ``{name}.safetensors`` for each entry of ``tensors`` plus ``state.json`` atomically."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files: dict[str, str] = {}
    for name, tdict in tensors.items():
        p = tmp / f"{name}.safetensors"
        save_file(tdict, str(p))
        _fsync_file(p)
        files[p.name] = file_sha256(p)
    for name, src in (extra_files or {}).items():
        p = tmp / name
        shutil.copyfile(src, p)
        _fsync_file(p)
        files[name] = file_sha256(p)
    state = {"format_version": FORMAT_VERSION, **state, "files": files}
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    _fsync_file(tmp / "state.json")
    _fsync_dir(tmp)
    if target.exists():
        # Replacing an existing checkpoint of the same name: move it aside first so that a crash
        # between the two renames still leaves one complete copy on disk.
        old = target.with_name(f".{target.name}.old{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old)
    else:
        os.replace(tmp, target)
    _fsync_dir(target.parent)
    return target


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run dir, its ``ckpt`` dir or the checkpoint dir itself."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist")
    if (p / "state.json").is_file():
        return p
    for base in (p / "ckpt", p):
        latest = base / "latest"
        if latest.is_file():
            name = latest.read_text().strip()
            cand = base / name
            if not (cand / "state.json").is_file():
                raise CheckpointError(f"checkpoint {str(cand)!r} named by {latest} is missing or incomplete")
            return cand
    raise CheckpointError(f"{str(p)!r} holds no checkpoint (no state.json or ckpt/latest)")


def read_state(ckpt: Path) -> dict[str, Any]:
    try:
        state = json.loads((ckpt / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt} has an unreadable state.json ({e.__class__.__name__})") from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {ckpt}: unsupported or missing format_version")
    for name, digest in state.get("files", {}).items():
        f = ckpt / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {ckpt} is incomplete: {name} is missing")
        if file_sha256(f) != digest:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} does not match its checksum")
    return state


def load_tensors(ckpt: Path, name: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(ckpt / f"{name}.safetensors"))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: cannot read {name}.safetensors ({e})") from None


def save_model(out_dir: str | Path, model: torch.nn.Module, run_cfg: RunConfig,
               tokenizer_path: str | Path | None = None, extra_state: dict[str, Any] | None = None) -> Path:
    """A weights-only checkpoint (for conversion, export, evaluation)."""
    extra = {"tokenizer.json": Path(tokenizer_path)} if tokenizer_path else None
    state = {"config": run_cfg.to_dict(), "config_hash": run_cfg.hash(), **(extra_state or {})}
    return write_checkpoint(Path(out_dir), {"model": model_tensors(model)}, state, extra)


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """Load (model, run_cfg, ckpt_dir) from any checkpoint; weights only, strict key match."""
    from archlab.model import build_model

    ckpt = resolve_checkpoint(path)
    state = read_state(ckpt)
    try:
        cfg = config_from_dict(state["config"])
    except ArchlabError as e:
        raise CheckpointError(f"checkpoint {ckpt} holds an invalid config: {e}") from None
    except KeyError:
        raise CheckpointError(f"checkpoint {ckpt}: state.json has no config") from None
    model = build_model(cfg.model)
    load_weights(model, load_tensors(ckpt, "model"), ckpt)
    return model.to(device), cfg, ckpt


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], where: Path) -> None:
    own = model_tensors(model)
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {where} does not fit the model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    for k, v in tensors.items():
        if own[k].shape != v.shape:
            raise CheckpointError(f"checkpoint {where}: {k} has shape {tuple(v.shape)}, "
                                  f"the model expects {tuple(own[k].shape)}")
    model.load_state_dict(tensors, strict=False)
