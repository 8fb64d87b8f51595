"""Corpora to token shards (``prepare``) and token shards to training batches (``TokenData``)."""

from archlab.data.loader import TokenData
from archlab.data.prepare import prepare

__all__ = ["TokenData", "prepare"]
