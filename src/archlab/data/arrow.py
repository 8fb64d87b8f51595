"""The data files of a Hugging Face ``Dataset.save_to_disk`` folder, as its ``state.json`` lists them.

Shared by the corpus reader (``archlab.data.sources``) and the downstream task reader
(``archlab.eval.tasks``), without a cycle: it depends on ``archlab.errors`` alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from archlab.errors import DataError


def save_to_disk_files(folder: Path) -> list[Path]:
    """The Arrow files named by ``folder/state.json``'s ``_data_files``, in order; every problem
    (unreadable JSON, no entries, a malformed entry, a missing file) is a one-line ``DataError``
    naming ``state.json``. Callers check first that ``state.json`` exists (their wording differs)."""
    state_path = folder / "state.json"
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{state_path} is not readable JSON ({e.__class__.__name__}: {e})") from None
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not entries:
        raise DataError(f"{state_path}: missing or empty field '_data_files' (the list of data files)")
    files = []
    for entry in entries:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            raise DataError(f"{state_path}: an entry of '_data_files' has no 'filename': {entry!r}")
        if not (folder / name).is_file():
            raise DataError(f"{state_path} names data file {name}, which does not exist in {folder}")
        files.append(folder / name)
    return files
