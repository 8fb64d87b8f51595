"""Process identities: which process holds something, and whether that process still exists.

A holder is named by pid, host and start time (``Owner``). The pid alone is not enough: pids are
reused, and a pid means nothing on another machine or in another pid namespace. So a holder is
*gone* when it is on this host (same host name and, on Linux, the same boot and pid namespace)
and no process has its pid, or the pid's process started at another time (reused), or it is a
zombie (it runs nothing and holds nothing). A holder on another host cannot be checked from here
(``Owner.checkable``): callers decide what that means (the lab's run claims use a heartbeat, a
run directory's claim a lock the kernel releases; ``archlab.io.run_dir``).

Here, in ``io``, because both the trainer (which claims its run directory) and the lab (which
claims runs in its results database) need it, and the trainer must not import the lab. Free of
torch.
"""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Owner:
    """A process, as a claim records it."""

    pid: int
    host: str  # socket.gethostname()
    boot: str  # Linux: "<boot id>/<pid namespace>", where ``pid`` is meaningful; "" elsewhere
    started: str  # the process's start time as this host reports it ("" when it cannot tell)

    @classmethod
    def current(cls) -> "Owner":
        return _owner(os.getpid())  # keyed by pid: a forked child is another owner

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"

    def checkable(self, me: "Owner | None" = None) -> bool:
        """Whether this process's pid can be looked up from ``me`` (default: this process): the
        same host, boot and pid namespace."""
        me = me or Owner.current()
        return self.host == me.host and self.boot == me.boot

    def exists(self) -> bool:
        """Whether this process still runs (only meaningful when ``checkable``): its pid is taken
        by a process that started when this one did (a start time unknown on either side is
        given the benefit of the doubt)."""
        started = process_started(self.pid)
        if started is None:
            return False
        return not (self.started and started and started != self.started)


@lru_cache(maxsize=8)
def _owner(pid: int) -> Owner:
    return Owner(pid=pid, host=socket.gethostname(), boot=_boot(), started=process_started(pid) or "")


@lru_cache(maxsize=1)
def _boot() -> str:
    """This kernel boot and pid namespace: two processes with equal values see the same pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        return f"{boot_id}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def process_started(pid: int) -> str | None:
    """When process ``pid`` started, as an opaque string ("" when this system cannot tell), or
    None when no (running) process has that pid. Compared with the value recorded in a claim, it
    tells the claim's process from a later one that reused the pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        stat = ""
    if stat:
        # Fields after the command name (which may hold spaces and parentheses): state is the
        # 3rd field of the line, starttime (clock ticks since boot) the 22nd.
        fields = stat[stat.rindex(")") + 2:].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process: it exists
    try:  # no /proc (macOS, BSD): ps reports the start time
        out = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if out.returncode != 0 and not out.stdout.strip():
        return None
    return out.stdout.strip()


__all__ = ["Owner", "process_started"]
