"""A run directory's guards: one writer at a time, and what a resume must find unchanged.

**One writer.** ``archlab train`` claims its run directory for as long as it trains
(``claim_run_dir``): an exclusive ``flock`` on ``RUN_DIR/.train.lock``, held by an open file.
Two trainers in one directory would interleave their checkpoints, ``config.yaml`` and
``metrics.jsonl`` into a run that neither of them trained, so the second is refused with one
line naming the holder (pid, host, since when) before it writes anything. The kernel drops the
lock when its process ends, however it ends (``kill -9`` included), so a dead holder never blocks
a later run; the lock file also holds a small JSON record of its holder, for the refusal's
message, which a clean exit empties: a record found under a free lock is a holder that was
killed, and the next trainer says that it takes the directory over. On a file system without
``flock`` (a few FUSE and network mounts answer ENOLCK or EOPNOTSUPP) the record alone decides:
a holder on this host is live while its process exists (``archlab.io.owner``); one on another
host cannot be checked, and the refusal says to delete the lock file once it is gone.

**The same config and the same data.** A resumed run must continue the run its checkpoint
holds. The config is compared by hash, and a refusal lists the keys that differ
(``config_changes``). The data is compared by a fingerprint of the prepared directory's
manifest (``data_fingerprint``: the tokenizer's sha256 and, per split, a digest of the shards'
names, sizes and sha256 as the manifest records them; opening the data verified the files
against those): the same ``data.path`` re-prepared from another corpus would otherwise be
trained on silently, and one loss curve would join two corpora.

Free of torch and of the data package (``io`` sits below both).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from archlab.config import TrainConfig
from archlab.errors import ArchlabError, CheckpointError
from archlab.io.owner import Owner

LOCK_FILE = ".train.lock"
#: errors of ``flock`` on a file system that has no such locks (the record then decides alone)
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
SHOWN_CHANGES = 3  # config keys a refusal names before "and N more"


class RunDirBusy(ArchlabError):
    """Another process is training into the run directory."""


# ---- one writer ----------------------------------------------------------------------------------
@contextlib.contextmanager
def claim_run_dir(out: Path, notify: Callable[[str], None]) -> Iterator[None]:
    """Hold ``out`` as this process's run directory for the block (creating it), or raise
    ``RunDirBusy`` naming the live holder; ``notify`` gets a line when a killed holder's
    directory is taken over."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lock = out / LOCK_FILE
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children (PEP 446)
    try:
        locked = _try_lock(fd)
        previous = _read_record(fd)
        me = Owner.current()
        if locked is None:
            raise RunDirBusy(_busy(out, previous))
        if previous is not None and previous[0] != me:
            holder, since = previous
            if not locked and (not holder.checkable(me) or holder.exists()):
                raise RunDirBusy(_busy(out, previous) + f" (this file system has no file locks: if that process "
                                 f"is gone, delete {lock} and run again)")
            notify(f"{out} was being trained by {holder.describe()}{_since(since)}, which ended without "
                   "releasing it (killed?); taking the run directory over")
        _write_record(fd, me)
    except BaseException:
        os.close(fd)
        raise
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # a clean exit leaves no holder on record
        os.close(fd)  # ... and closing the file releases the lock


def _try_lock(fd: int) -> bool | None:
    """True: locked; None: another process holds the lock; False: no locks on this file system."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return None
    except OSError as e:
        if e.errno in _NO_LOCKS:
            return False
        raise
    return True


def _read_record(fd: int) -> tuple[Owner, float] | None:
    """The holder the lock file names, or None when it names none (released, or not yet written:
    a holder writes its record a moment after taking the lock)."""
    try:
        raw = json.loads(os.pread(fd, 4096, 0) or b"null")
        owner = Owner(pid=int(raw["pid"]), host=str(raw["host"]), boot=str(raw["boot"]),
                      started=str(raw["started"]))
        return owner, float(raw["since"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _write_record(fd: int, me: Owner) -> None:
    record = json.dumps({"pid": me.pid, "host": me.host, "boot": me.boot, "started": me.started,
                         "since": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)


def _since(since: float) -> str:
    return f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"


def _busy(out: Path, holder: tuple[Owner, float] | None) -> str:
    who = "another process" if holder is None else f"{holder[0].describe()}{_since(holder[1])}"
    return (f"{out} is being trained by {who}; two trainers in one run directory would mix their "
            "checkpoints and logs: wait for it to end (or stop it), or train into another --out")


# ---- the same data -------------------------------------------------------------------------------
_FINGERPRINT_NAMES = {"tokenizer_sha256": "its tokenizer", "train_sha256": "its train shards",
                      "val_sha256": "its val shards"}


def data_fingerprint(manifest: dict[str, Any]) -> dict[str, str]:
    """What identifies a prepared data directory's tokens: its tokenizer's sha256, and per split a
    sha256 over its shards' names, token counts and sha256 (as its manifest records them)."""
    fingerprint = {"tokenizer_sha256": str(manifest["tokenizer"]["sha256"])}
    for split, entry in sorted(manifest["splits"].items()):
        digest = hashlib.sha256()
        for shard in entry["shards"]:
            digest.update(f"{shard['file']} {shard['n_tokens']} {shard['sha256']}\n".encode())
        fingerprint[f"{split}_sha256"] = digest.hexdigest()
    return fingerprint


def check_same_data(recorded: dict[str, str] | None, current: dict[str, str], *, run: Path, ckpt: Path,
                    data_path: str) -> None:
    """Refuse to resume ``run`` (from checkpoint ``ckpt``) on data other than it was trained on.

    ``recorded`` None: a checkpoint written before runs recorded their data's fingerprint; it
    resumes as it always did, since there is nothing to compare with."""
    if recorded is None:
        return
    changed = [_FINGERPRINT_NAMES.get(k, k) for k in sorted(set(recorded) | set(current))
               if recorded.get(k) != current.get(k)]
    if changed:
        raise CheckpointError(
            f"the data in {data_path} changed since {run} started ({' and '.join(changed)} differ from "
            f"what {ckpt / 'state.json'} records): resuming would train on other tokens and join two "
            f"corpora in one loss curve; train into a new --out, or put the original data back in "
            f"{data_path} (prepare it again from the same source and tokenizer)")


# ---- the same config -----------------------------------------------------------------------------
_ABSENT = object()


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every config key whose value differs between two ``RunConfig.to_dict``
    trees (dotted keys, in the old tree's order, then keys only the new one has), leaving out the
    layout fields the config hash leaves out."""
    before, after = _flat(old), _flat(new)
    layout = {f"train.{name}" for name in TrainConfig.LAYOUT_FIELDS}
    keys = [k for k in before if k not in layout] + [k for k in after if k not in before and k not in layout]
    return [f"{k}: {_show(before.get(k, _ABSENT))} -> {_show(after.get(k, _ABSENT))}"
            for k in keys if before.get(k, _ABSENT) != after.get(k, _ABSENT)]


def describe_changes(changes: list[str], shown: int = SHOWN_CHANGES) -> str:
    """The first ``shown`` changes, then ``and N more``."""
    text = ", ".join(changes[:shown])
    return text + (f" and {len(changes) - shown} more" if len(changes) > shown else "")


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value: Any) -> str:
    """A value as it would be written in YAML or ``--set``."""
    if value is _ABSENT:
        return "(absent)"
    if value is None or isinstance(value, (bool, list, dict)):
        return json.dumps(value)
    return str(value)


__all__ = ["LOCK_FILE", "RunDirBusy", "check_same_data", "claim_run_dir", "config_changes", "data_fingerprint",
           "describe_changes"]
