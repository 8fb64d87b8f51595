"""Who is training a run: process identities, whether a claim's holder still exists, and pool
workers that die with the process that started them.

A run of a suite is trained by the process that *claims* it in the results database
(``ResultStore.claim_run``): the claim names that process by pid, host and start time. A claim
is live while that process exists; a process killed with SIGKILL cannot release what it holds,
so every reader decides for itself whether a claim's holder is gone:

* same host (same host name, and on Linux the same boot and pid namespace, so that the pid means
  the same process here): gone when no process has the pid, or the pid's process started at
  another time (the pid was reused), or it is a zombie (it runs nothing and holds no memory);
* another host, or a pid namespace this process cannot see into (a container sharing the suite
  directory): a pid cannot be checked from here, so the claim's heartbeat decides. The holder
  refreshes it every ``HEARTBEAT_S`` while it trains (``ResultStore.Heartbeat``); a claim not
  refreshed for ``STALE_AFTER_S`` is gone: the claim is a *lease*. Both are set per process by
  the environment, ``ARCHLAB_CLAIM_HEARTBEAT_S`` and ``ARCHLAB_CLAIM_LEASE_S`` (``heartbeat_s``,
  ``lease_s``): every machine sharing a suite directory must use the same lease, since each
  reader judges others' claims by its own.

Pool workers (``archlab compare --jobs N``) call ``die_with_parent`` first: on Linux the kernel
kills them when their parent dies (``PR_SET_PDEATHSIG``), and on every system a watcher thread
ends them when their parent process changes. Without it a ``kill -9`` of ``compare`` orphans
workers that keep training, then wait forever for work that never comes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

from archlab.errors import ConfigError
# Process identities live in ``io`` (the trainer claims its run directory with them and must not
# import the lab); re-exported here, where the lab's claims have always imported them from.
from archlab.io.owner import Owner, process_started

HEARTBEAT_S = 30.0  # how often a claim holder refreshes its claims
STALE_AFTER_S = 300.0  # a claim from a process that cannot be checked is gone after this silence
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name}={raw!r}: expected a positive number of seconds")
    return value


def heartbeat_s() -> float:
    """How often a claim holder refreshes its claims: ``ARCHLAB_CLAIM_HEARTBEAT_S`` or ``HEARTBEAT_S``."""
    return _seconds("ARCHLAB_CLAIM_HEARTBEAT_S", HEARTBEAT_S)


def lease_s() -> float:
    """After how long without a heartbeat a claim that cannot be checked by pid is gone:
    ``ARCHLAB_CLAIM_LEASE_S`` or ``STALE_AFTER_S``. Shorter: a dead machine's runs are taken over
    sooner; but at least two heartbeats long, or a live holder that misses one beat (the database
    busy) would lose its run to a second trainer."""
    lease, beat = _seconds("ARCHLAB_CLAIM_LEASE_S", STALE_AFTER_S), heartbeat_s()
    if lease < 2 * beat:
        raise ConfigError(f"a claim lease of {lease:g} s is shorter than two heartbeats ({beat:g} s each); "
                          "raise ARCHLAB_CLAIM_LEASE_S or lower ARCHLAB_CLAIM_HEARTBEAT_S")
    return lease


def holder_alive(holder: Owner, heartbeat_at: float, *, me: Owner | None = None,
                 now: float | None = None) -> bool:
    """Whether the process that holds a claim still exists (see the module docstring)."""
    if holder.checkable(me):
        return holder.exists()
    return (now if now is not None else time.time()) - heartbeat_at < lease_s()


# Filesystems where SQLite's WAL mode is not safe between processes of different hosts (no shared
# memory for the WAL index), and usually not even its locks: a suite directory must not be there.
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "fuse.sshfs",
                       "ceph", "fuse.ceph", "glusterfs", "fuse.glusterfs", "lustre", "gpfs", "beegfs")


def network_filesystem(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the network filesystem ``path`` is on (``nfs4``, ...), or None when it is on a
    local one or this system cannot tell (no /proc/self/mountinfo). ``mountinfo``: that file's
    text (tests)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, fstype = "", None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, line.split(" - ", 1)[1].split()[0]
    return fstype if fstype in NETWORK_FILESYSTEMS else None


def die_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """End this process when ``parent_pid`` (its parent now) dies: the pool initializer of
    ``compare --jobs``. SIGKILL, not an exception: the run's checkpoints are what survives, and
    a dying worker must not wait for anything (a lock, a queue) the dead parent held."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watcher below still covers it
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_watch_parent, args=(parent_pid, poll_s), name="archlab-parent-watch",
                     daemon=True).start()


def _watch_parent(parent_pid: int, poll_s: float) -> None:
    """The portable half: an orphan is re-parented (to init or a subreaper), so its parent pid
    changes; that is the signal to go."""
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGKILL)
