"""Where recipes keep their downloads, extracted files and cleaned text, and how a killed run's
leftovers are removed.

Every cache entry appears by renaming a finished temporary (``.tmp-*``) sibling into place, so
an interrupted download, extraction or cleaning leaves only a temporary, never a half entry;
:func:`remove_stale` deletes temporaries old enough to belong to no running process.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from archlab.io.files import cache_home

CACHE_ENV = "ARCHLAB_CACHE"
# Temporaries older than this are taken for leftovers of a killed run and removed.
STALE_TMP_S = 6 * 3600


def default_cache_dir() -> Path:
    """``$ARCHLAB_CACHE`` if set, else ``$XDG_CACHE_HOME/archlab/recipes`` (``~/.cache/...``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return cache_home() / "recipes"


def remove_stale(folder: Path) -> None:
    """Temporaries left by a killed run (never a finished entry); recent ones may belong to a
    run still in progress and stay."""
    now = time.time()
    for stale in folder.glob(".tmp-*"):
        try:
            if now - stale.stat().st_mtime < STALE_TMP_S:
                continue
        except OSError:
            continue
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)

