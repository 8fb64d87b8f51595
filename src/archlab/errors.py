"""User-facing errors.

Anything a user can cause (a bad config, a missing data directory, a corrupt checkpoint, a bad CLI
argument) raises an ``ArchlabError``; the CLI prints its message as one line and exits non-zero.
So does a path the file system refuses (read-only, no permission, full: ``unwritable_path``),
wherever the write is. Internal bugs stay ordinary exceptions so that their tracebacks are not
hidden.
"""

import errno
import os
from collections.abc import Callable


class ArchlabError(Exception):
    """An error caused by the user's input; printed as one line by the CLI."""

    exit_code = 1


class ConfigError(ArchlabError):
    """A bad config key, value or combination (exit code 2, nothing written)."""

    exit_code = 2


class DataError(ArchlabError):
    """Missing, malformed or mismatched data."""


class CheckpointError(ArchlabError):
    """A missing, truncated or corrupted checkpoint."""


class Unwritable(ArchlabError):
    """A path that cannot be written: a read-only file system, missing permission, a full disk
    or quota. Made by ``unwritable_path`` from the ``OSError``, naming the path the user asked
    for rather than a hidden temporary it was being built in."""


class DiskFull(Unwritable):
    """No space left on the device being written; what was there before is kept."""


class TrainingDiverged(ArchlabError):
    """The loss became non-finite; the last good checkpoint is kept."""


class UsageError(ArchlabError):
    """A command-line argument out of its range (exit code 2, like argparse's own errors)."""

    exit_code = 2


class OutOfMemory(ArchlabError):
    """The accelerator ran out of memory: a resource limit the user sets (batch size, runs per
    device), not a bug, so it is one line with what to change. Checkpoints already written stay."""


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is torch's out-of-memory error (by name: this module must not import torch,
    and an error from a worker process arrives unpickled as the same type)."""
    return type(e).__name__ == "OutOfMemoryError" or str(e).startswith("CUDA out of memory")


# Why a path cannot be written, and what the user can do about it. Only these errno values:
# each says the file system refused the user's path, never that the code asked for the wrong one
# (ENOENT, EISDIR, EBADF ... keep their tracebacks).
_REFUSALS = {
    errno.EROFS: "{path} is on a read-only file system: nothing can be written there; choose another "
                 "path (e.g. another --out) or remount it read-write",
    errno.EACCES: "permission denied on {path}: this user may not write (or read) it; change its "
                  "permissions or choose another path (e.g. another --out)",
    errno.EPERM: "operation not permitted on {path}: this user may not change it; change its "
                 "permissions or choose another path (e.g. another --out)",
    errno.ENOSPC: "no space left on device: writing {path} failed, its file system is full; free some "
                  "space there (or write elsewhere) and run again",
    errno.EDQUOT: "disk quota exceeded: writing {path} failed; free some space within the quota (or "
                  "write elsewhere) and run again",
}
_FULL = (errno.ENOSPC, errno.EDQUOT)
# Permission errors without a file are not about a path (a signal to another user's process, a
# privileged port): those stay tracebacks. The others can only come from a file system.
_NEEDS_A_PATH = (errno.EACCES, errno.EPERM)


def unwritable_path(e: OSError, destination: Callable[[str], object] = str) -> Unwritable | None:
    """``e`` as one line naming the path and the reason, or None when ``e`` is not a file system
    refusing a path (then it is a bug or an unexpected condition, and its traceback is kept).

    ``destination`` maps the failing path to the one to name: the command line passes
    ``archlab.io.temporaries.destination``, so that a temporary (``.NAME.tmp-HOST-PID-XXXXXXXX``)
    is named as what it stands for: the user asked for ``run/ckpt/step_0000006``, not for the
    hidden directory it is built in. (A parameter, since this module imports nothing of
    archlab: every package imports it.)"""
    template = _REFUSALS.get(e.errno)
    if template is None or (e.filename is None and e.errno in _NEEDS_A_PATH):
        return None
    if e.filename is None or isinstance(e.filename, int):  # a write or close names no file
        path = "a file the system did not name"
    else:
        path = str(destination(os.fsdecode(e.filename)))
    cls = DiskFull if e.errno in _FULL else Unwritable
    return cls(template.format(path=path))
