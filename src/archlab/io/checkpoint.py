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
file named in ``state.json`` so that truncation or corruption is reported, never silently used,
and the report names the newest checkpoint of the run that is still intact.

Temporaries are named like those of ``archlab data prepare`` (``.NAME.tmp-HOST-PID-XXXXXXXX``,
``.NAME.old-HOST-PID-XXXXXXXX``, see ``archlab.io.temporaries``): a process that is killed cannot remove its own, and on a full
disk they would keep it full, so writing a checkpoint (and starting a run) first removes those
of processes that are gone. A full disk is one ``DiskFull`` line naming the path that could not
be written; the temporary is removed and the previous checkpoint stays where it was.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from archlab.config import RunConfig, config_from_dict
from archlab.errors import ArchlabError, CheckpointError, DiskFull
from archlab.io.files import file_sha256
from archlab.io.temporaries import TEMPORARY, host, process_exists, temporary_path

FORMAT_VERSION = 1
STEP_GLOB = "step_*"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- temporaries and full disks -----------------------------------------------------------------
# Names written before temporaries carried the host: ``.step_0000100.tmp1234`` (a checkpoint being
# built), ``.step_0000100.old1234`` (one being replaced), ``.latest.tmp1234`` and the run files'
# ``.config.yaml.tmp1234`` / ``.metrics.jsonl.tmp1234``. Only these run-directory names are read,
# so a foreign ``.x.tmp5`` elsewhere is never touched.
_LEGACY = re.compile(r"^\.(?P<name>step_\d+|latest|config\.yaml|metrics\.jsonl)\.(?P<kind>tmp|old)(?P<pid>\d+)$")


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Remove the temporaries in ``folder`` that no running process on this host owns; return them.

    A build (``tmp``) of a dead process goes. A parked previous copy (``old``) goes once its
    name holds a complete checkpoint again; if nothing holds the name (killed between the two
    renames of a replacement), it is the only complete copy and is renamed back instead. Never
    raises: what cannot be removed stays, and the caller's own work is what matters.
    """
    folder = Path(folder)
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    here = host()
    for path in entries:
        m = TEMPORARY.match(path.name)
        if m is not None and m["host"] != here:
            continue  # another machine's, on a shared file system: its process cannot be checked
        m = m or _LEGACY.match(path.name)
        if m is None:
            continue
        try:
            if path.is_symlink() or process_exists(int(m["pid"])):
                continue
            if m["kind"] == "old":
                final = folder / m["name"]
                if not final.exists():
                    os.replace(path, final)
                    continue
                if not (final / "state.json").is_file():
                    continue  # not a checkpoint's name (prepared data has its own cleanup)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink()
        except OSError:
            continue
        if not path.exists():
            removed.append(path)
    return removed


def _discard(path: Path) -> None:
    """Remove a temporary file or directory; never raises, so it cannot hide the error that
    made it a leftover."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Give an OSError the file it is about (a failed write or close names none), and turn the
    I/O errors safetensors reports as ``SafetensorError("... (os error N)")`` into OSErrors."""
    try:
        yield
    except SafetensorError as e:
        m = re.search(r"\(os error (\d+)\)", str(e))
        if m is None:
            raise
        code = int(m[1])
        raise OSError(code, os.strerror(code), str(path)) from e
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


@contextlib.contextmanager
def full_disk_is_an_error(path: Path, kept: str) -> Iterator[None]:
    """"No space left on device" while writing ``path`` as one ``DiskFull`` line: which file
    could not be written and ``kept`` (what is still intact). Other errors pass unchanged."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        where = e.filename or path
        raise DiskFull(f"no space left on device: writing {where} failed, its file system is full; "
                       f"{kept}; free some space there (or write elsewhere) and run again") from None


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` all at once: a crash leaves the old or the new content."""
    path = Path(path)
    tmp = temporary_path(path, "tmp")
    kept = f"{path} is unchanged" if path.exists() else f"{path} was not written"
    with full_disk_is_an_error(path, kept):
        try:
            with _naming(tmp), open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _discard(tmp)
            raise
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
    with full_disk_is_an_error(target, _kept_on_failure(target)):
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target.parent)  # a killed run's leftovers may be what fills the disk
        tmp = temporary_path(target, "tmp")
        try:
            _build(tmp, tensors, state, extra_files)
            _install(tmp, target)
        except BaseException:
            _discard(tmp)
            raise
    _fsync_dir(target.parent)
    return target


def _build(tmp: Path, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
           extra_files: dict[str, Path] | None) -> None:
    tmp.mkdir()
    names = []
    for name, tdict in tensors.items():
        p = tmp / f"{name}.safetensors"
        with _naming(p):
            save_file(tdict, str(p))
        names.append(p.name)
    finish_build(tmp, names, state, extra_files)


def finish_build(tmp: Path, written: list[str], state: dict[str, Any],
                 extra_files: dict[str, Path] | None) -> None:
    """Complete a checkpoint being built in ``tmp`` whose files ``written`` are there already:
    fsync and hash them, copy ``extra_files`` in, write ``state.json`` (used directly by the
    sharded format, whose shards every rank writes itself; ``archlab.io.dcp``)."""
    files: dict[str, str] = {}
    for name in written:
        p = tmp / name
        with _naming(p):
            _fsync_file(p)
        files[name] = file_sha256(p)
    for p in sorted(tmp.rglob("*")):  # files written by other processes (sharded checkpoints)
        if p.name in files:
            continue
        with _naming(p):
            _fsync_dir(p) if p.is_dir() else _fsync_file(p)
    for name, src in (extra_files or {}).items():
        p = tmp / name
        with _naming(p):
            shutil.copyfile(src, p)
            _fsync_file(p)
        files[name] = file_sha256(p)
    state = {"format_version": FORMAT_VERSION, **state, "files": files}
    with _naming(tmp / "state.json"):
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        _fsync_file(tmp / "state.json")
    _fsync_dir(tmp)


def install_built(tmp: Path, target: Path) -> None:
    """Rename a finished checkpoint build into place (see ``_install``) and make it durable."""
    with full_disk_is_an_error(target, _kept_on_failure(target)):
        _install(tmp, target)
    _fsync_dir(target.parent)


def discard(path: Path) -> None:
    """Remove a checkpoint being built (never raises)."""
    _discard(path)


def _install(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` to ``target``. Replacing an existing checkpoint of the same
    name moves it aside first, so that a crash between the two renames still leaves one complete
    copy on disk (``remove_stale_temporaries`` renames it back)."""
    if not target.exists():
        os.replace(tmp, target)
        return
    old = temporary_path(target, "old")
    os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.replace(old, target)
        raise
    _discard(old)


def _kept_on_failure(target: Path) -> str:
    """What a failed write of ``target`` leaves intact, for its error message."""
    if target.exists():
        return f"the existing {target} is unchanged"
    latest = target.parent / "latest"
    try:
        name = latest.read_text().strip()
    except OSError:
        return f"{target} was not written"
    return (f"{target} was not written and the last checkpoint, {target.parent / name}, is kept "
            f"({latest} still names it)")


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
                raise CheckpointError(f"checkpoint {str(cand)!r} named by {latest} is missing or incomplete"
                                      + _intact_hint(cand))
            return cand
    raise CheckpointError(f"{str(p)!r} holds no checkpoint (no state.json or ckpt/latest)")


def read_state(ckpt: Path, unread: tuple[str, ...] = ()) -> dict[str, Any]:
    """``state.json`` of ``ckpt``, after checking every file it names against its sha256 (those
    in ``unread``, which the caller never opens, only for being there); a damaged checkpoint's
    error names the newest intact one beside it."""
    try:
        return _verified_state(ckpt, unread)
    except CheckpointError as e:
        raise CheckpointError(f"{e}{_intact_hint(ckpt)}") from None


#: what a weights-only load never reads: the optimizer's moments, twice the weights' bytes, whose
#: hashing was 1.2 of a 124m model's 5.5 s load on CPU (the resume path still checks them)
WEIGHTS_ONLY_UNREAD = ("optim.safetensors",)


def _verified_state(ckpt: Path, unread: tuple[str, ...] = ()) -> dict[str, Any]:
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
        if name not in unread and file_sha256(f) != digest:
            raise CheckpointError(f"checkpoint {ckpt} is corrupt: {name} does not match its checksum")
    return state


def _step_of(path: Path) -> int:
    digits = path.name.removeprefix("step_")
    return int(digits) if digits.isdigit() else -1


def _intact_hint(bad: Path) -> str:
    """``; the newest intact checkpoint is ...`` for a damaged checkpoint of a run (its sibling
    ``step_*`` directories, each verified as a load would), or "" when it has no siblings.

    Hashing the candidates costs as much as loading them, which is fine on this error path: the
    user's next step is to load one of them anyway.
    """
    base = bad.parent
    try:
        others = [p for p in base.glob(STEP_GLOB) if p.is_dir() and p.name != bad.name]
    except OSError:
        return ""
    if not others:
        return ""
    latest = base / "latest"
    for cand in sorted(others, key=_step_of, reverse=True):
        try:
            _verified_state(cand)
        except CheckpointError:
            continue
        return (f"; the newest intact checkpoint is {cand} (pass it as --ckpt to eval, generate or serve; "
                f"to resume training from it, point {latest} at it: echo {cand.name} > {latest})")
    return f"; no other checkpoint in {base} is intact"


def load_tensors(ckpt: Path, name: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    try:
        return load_file(str(ckpt / f"{name}.safetensors"), device=str(device))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: cannot read {name}.safetensors ({e})"
                              + _intact_hint(ckpt)) from None


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
    state = read_state(ckpt, unread=WEIGHTS_ONLY_UNREAD)
    try:
        cfg = config_from_dict(state["config"])
    except ArchlabError as e:
        raise CheckpointError(f"checkpoint {ckpt} holds an invalid config: {e}") from None
    except KeyError:
        raise CheckpointError(f"checkpoint {ckpt}: state.json has no config") from None
    if state.get("format") == "dcp" and "model.safetensors" not in state.get("files", {}):
        raise CheckpointError(f"checkpoint {ckpt} is sharded (saved by a distributed run before its end); "
                              f"write its weights as safetensors first: archlab checkpoint consolidate {ckpt} "
                              "--out DIR")
    device = torch.device(device)
    # Built where it will run and without drawing its random init: every parameter and persistent
    # buffer is overwritten below (load_weights refuses a missing key), and on CPU the draws were
    # 2.5 of a 124m model's 5.5 s load; on CUDA this also skips copying a random model across.
    with torch.device(device), init_skipped():
        model = build_model(cfg.model)
    load_weights(model, load_tensors(ckpt, "model", device), ckpt)
    return model.to(device), cfg, ckpt


#: the ``torch.nn.init`` functions that module constructors draw or fill their parameters with
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


@contextlib.contextmanager
def init_skipped() -> Iterator[None]:
    """Modules built inside leave their parameters as allocated (uninitialised memory): only for a
    model whose every tensor is loaded next. Not thread-safe (it swaps module attributes)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS if hasattr(torch.nn.init, name)}
    try:
        for name in saved:
            setattr(torch.nn.init, name, _leave_as_is)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _leave_as_is(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: ARG001
    return tensor


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
