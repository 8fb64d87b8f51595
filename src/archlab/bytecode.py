"""Bytecode that survives the process where the installed packages' own cannot be written.

Python caches each module's compiled bytecode beside its source (``__pycache__``) the first time
it imports it. Where the site-packages are read-only or the environment sets
``PYTHONDONTWRITEBYTECODE`` (common in container images), nothing is cached and every process
compiles torch's source again: on the H200 machine's image 1,705 modules, 5.2 s of a 12 s
``archlab generate`` (cProfile, docs/benchmarks.md, seventeenth session). When torch's own
bytecode is missing, the command line points Python at a cache of its own
(``sys.pycache_prefix``) before it imports torch, so the second process reads what the first
compiled. Nothing changes where torch's bytecode exists (a normal ``pip install`` writes it).

``ARCHLAB_CACHE_DIR`` moves the cache (default ``$XDG_CACHE_HOME/archlab``, else
``~/.cache/archlab``); ``ARCHLAB_BYTECODE_CACHE=0`` turns this off.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def cache_dir() -> Path:
    """archlab's cache folder (``ARCHLAB_CACHE_DIR``, else the XDG cache home's ``archlab``)."""
    if os.environ.get("ARCHLAB_CACHE_DIR"):
        return Path(os.environ["ARCHLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "archlab"


def has_own_bytecode(module: str = "torch") -> bool:
    """Whether ``module``'s ``__init__`` has bytecode where Python looks without a prefix (or the
    module is not installed, or has no source: nothing to compile)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return True
    prefix = sys.pycache_prefix
    try:
        sys.pycache_prefix = None  # where the package's own __pycache__ would hold it
        pyc = importlib.util.cache_from_source(spec.origin)
    finally:
        sys.pycache_prefix = prefix
    return os.path.exists(pyc)


def enable_bytecode_cache(module: str = "torch") -> Path | None:
    """Cache bytecode under ``cache_dir()/pycache`` when ``module`` (imported next, and heavy) has
    none of its own; the folder used, or None when nothing was changed. Call before importing it."""
    if os.environ.get("ARCHLAB_BYTECODE_CACHE", "1") == "0" or sys.pycache_prefix is not None:
        return None  # turned off, or the user chose a prefix (PYTHONPYCACHEPREFIX) already
    if module in sys.modules or has_own_bytecode(module):
        return None
    folder = cache_dir() / "pycache"
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
