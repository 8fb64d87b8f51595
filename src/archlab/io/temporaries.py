"""Names of temporaries that tell a dead writer's leftovers from a live writer's work.

A file or directory is built under ``.NAME.tmp-HOST-PID-XXXXXXXX`` beside ``NAME`` and renamed
into place; one being replaced is parked as ``.NAME.old-HOST-PID-XXXXXXXX`` for an instant. A
process that is killed (SIGKILL, out of memory, power loss) cannot remove its own, so the next
writer removes those whose process is gone; host and pid in the name tell which those are, and
another host's (a shared file system) are left alone.

Checkpoints (``archlab.io.checkpoint``) and prepared data (``archlab.data.prepare``) both name
their temporaries this way, so either cleanup reads the other's names the same way, and an
error while writing one names the path it stands for (``destination``). Free of torch.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from pathlib import Path

TEMPORARY = re.compile(
    r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-[0-9a-f]{8}$")



def host() -> str:
    """This machine's name as it appears in temporaries' names."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def temporary_path(out: Path, kind: str, pid: int | None = None) -> Path:
    """A new name for a temporary (``kind`` tmp or old) of ``out``, owned by process ``pid``
    (default: this one) on this host."""
    pid = os.getpid() if pid is None else pid
    return out.with_name(f".{out.name}.{kind}-{host()}-{pid}-{uuid.uuid4().hex[:8]}")


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (in doubt: yes, so nothing live is removed)."""
    if pid <= 0:
        return True  # not a process id a writer could have had: never treat it as dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


def destination(path: str | Path) -> Path:
    """The path a temporary stands for, so that an error names what the user asked to write:
    ``run/ckpt/.step_0000006.tmp-HOST-PID-XXXXXXXX/model.safetensors`` is
    ``run/ckpt/step_0000006/model.safetensors``. Every component is read, since a failing file
    is often inside a directory being built; a path without temporaries comes back unchanged."""
    parts = [m["name"] if (m := TEMPORARY.match(part)) else part
             for part in Path(path).parts]
    return Path(*parts) if parts else Path(path)
