"""Bytecode that survives the process where the installed packages' own cannot be written.

Python caches each module's compiled bytecode beside its source (``__pycache__``) the first time
it imports it. Where the site-packages are read-only or the environment sets
``PYTHONDONTWRITEBYTECODE`` (common in container images), nothing is cached and every process
compiles torch's source again: on the H200 machine's image 1,705 modules, 5.2 s of a 12 s
``archlab generate`` (cProfile, docs/benchmarks.md, seventeenth session). When torch's own
bytecode is missing, the command line points Python at a cache of its own
(``sys.pycache_prefix``) before it imports torch, so the second process reads what the first
compiled. Nothing changes where torch's bytecode exists (a normal ``pip install`` writes it).

``ARCHLAB_PYCACHE`` names the folder (default ``pycache`` in ``archlab.io.files.cache_home()``,
``~/.cache/archlab``), or is ``off``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from archlab.io.files import cache_home

PYCACHE_ENV = "ARCHLAB_PYCACHE"


def enable_bytecode_cache(module: str = "torch") -> Path | None:
    """Cache bytecode in archlab's folder when ``module`` (imported next, and heavy) has none of
    its own; the folder used, or None when nothing was changed. Call before importing it."""
    choice = os.environ.get(PYCACHE_ENV, "")
    if choice == "off" or sys.pycache_prefix is not None or module in sys.modules:
        return None  # turned off, the user's own prefix (PYTHONPYCACHEPREFIX), or too late
    spec = importlib.util.find_spec(module)
    if spec is None or not (spec.origin or "").endswith(".py"):
        return None  # not installed, or no source to compile
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):  # no prefix: its own __pycache__
        return None
    folder = Path(choice).expanduser() if choice else cache_home() / "pycache"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # no writable cache either: import as before
    if not os.access(folder, os.W_OK):
        return None
    sys.pycache_prefix = str(folder)
    # Only into archlab's own cache: the reason for PYTHONDONTWRITEBYTECODE (no files written
    # among the installed packages) holds there.
    sys.dont_write_bytecode = False
    return folder
