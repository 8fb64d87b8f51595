"""Task items (what the scorer consumes) and rows (what task files hold), with field access that
names the file, the row and the field when something is missing or of the wrong type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from archlab.errors import DataError


# ---- items ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MCItem:
    context: str
    continuations: tuple[str, ...]
    gold: int
    contexts: tuple[str, ...] | None = None  # one context per continuation (WinoGrande)

    def pairs(self) -> list[tuple[str, str]]:
        """(context, continuation) of each choice, in order."""
        ctxs = self.contexts if self.contexts is not None else (self.context,) * len(self.continuations)
        return list(zip(ctxs, self.continuations))


@dataclass(frozen=True)
class LambadaItem:
    context: str
    target: str


Item = MCItem | LambadaItem


# ---- rows: field access that names the file, row and field on failure ----------------------------
class Row:
    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise DataError(f"{where}: expected an object with named fields, got {type(data).__name__}")
        self.data = data
        self.where = where

    def has(self, *keys: str) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> Any:
        if key not in self.data or self.data[key] is None:
            have = ", ".join(sorted(self.data)) or "none"
            raise DataError(f"{self.where}: missing field {key!r} (fields present: {have})")
        return self.data[key]

    def str(self, key: str) -> str:
        v = self.get(key)
        if not isinstance(v, str):
            raise DataError(f"{self.where}: field {key!r} must be a string, got {type(v).__name__}")
        return v

    def strs(self, key: str, at_least: int = 1) -> list[str]:
        v = self.get(key)
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise DataError(f"{self.where}: field {key!r} must be a list of strings")
        if len(v) < at_least:
            raise DataError(f"{self.where}: field {key!r} needs at least {at_least} entries, has {len(v)}")
        return v

    def int(self, key: str) -> int:
        v = self.get(key)
        if isinstance(v, bool):
            v = None
        elif isinstance(v, str) and v.strip().lstrip("-").isdigit():
            v = int(v)
        if not isinstance(v, int):
            raise DataError(f"{self.where}: field {key!r} must be an integer, got {self.data[key]!r}")
        return v

    def sub(self, key: str) -> "Row":
        return Row(self.get(key), f"{self.where}, field {key!r}")


def check_gold(row: Row, gold: int, n: int, key: str) -> int:
    if not 0 <= gold < n:
        raise DataError(f"{row.where}: field {key!r} gives answer index {gold}, outside 0..{n - 1}")
    return gold
