"""The command-line clients recipes run (``pip``, ``apt-get``, ``dpkg-deb``) and how their
output is shortened into one-line errors.

Callers use ``tools.run_tool(...)`` through this module (not a copied name), so a test can
replace it here with a fake registry.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from archlab.errors import DataError

# Seconds allowed per registry command.
TOOL_TIMEOUT_S = 1800


def run_tool(cmd: list[str], cwd: Path) -> tuple[int, str]:
    """Run a registry client; return its exit status and its stdout and stderr together."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, errors="replace",
                              timeout=TOOL_TIMEOUT_S, check=False)
    except FileNotFoundError:
        tool = Path(cmd[0]).name
        need = " (recipes from Debian packages need apt-get and dpkg-deb)" if tool.startswith(("apt", "dpkg")) \
            else ""
        raise DataError(f"{tool} is not installed{need}") from None
    except subprocess.TimeoutExpired:
        raise DataError(f"`{' '.join(cmd[:3])} ...` gave no result within {TOOL_TIMEOUT_S} s; "
                        "the registry is unreachable or too slow") from None
    return proc.returncode, (proc.stdout or "") + (proc.stderr or "")


def first_line(text: str) -> str:
    """The last error line of a tool's output (or its last line), squeezed onto one line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("ERROR", "E:", "Err:"))]
    return squeeze((errors or lines or ["no output"])[-1])


def squeeze(line: str, limit: int = 200) -> str:
    line = re.sub(r"\s+", " ", line).strip()
    return line if len(line) <= limit else line[:limit - 3] + "..."

