"""Corpora to token shards (``prepare``) and token shards to training batches (``TokenData``).

``TokenData`` (which imports torch) is imported on use, so that the command line can build its
parser without torch.
"""

from __future__ import annotations

# Bound eagerly: importing the submodule ``archlab.data.prepare`` would otherwise leave the
# package attribute ``prepare`` naming the module rather than the function.
from archlab.data.prepare import prepare

__all__ = ["TokenData", "prepare"]


def __getattr__(name: str):
    if name == "TokenData":
        from archlab.data.loader import TokenData

        return TokenData
    raise AttributeError(name)
