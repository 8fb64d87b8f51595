"""Corpora to token shards (``prepare``) and token shards to training batches (``TokenData``).

Submodules are imported on use (``archlab.data.TokenData`` imports torch), so that the command
line can build its parser without them.
"""

from __future__ import annotations

__all__ = ["TokenData", "prepare"]


def __getattr__(name: str):
    if name == "TokenData":
        from archlab.data.loader import TokenData

        return TokenData
    if name == "prepare":
        from archlab.data.prepare import prepare

        return prepare
    raise AttributeError(name)
