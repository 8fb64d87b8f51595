"""User-facing errors.

Anything a user can cause (a bad config, a missing data directory, a corrupt checkpoint, a bad CLI
argument) raises an ``ArchlabError``; the CLI prints its message as one line and exits non-zero.
Internal bugs stay ordinary exceptions so that their tracebacks are not hidden.
"""


class ArchlabError(Exception):
    """An error caused by the user's input; printed as one line by the CLI."""

    exit_code = 1


class ConfigError(ArchlabError):
    """A bad config key, value or combination (exit code 2, nothing written)."""

    exit_code = 2


class DataError(ArchlabError):
    """Missing, malformed or mismatched data."""


class CheckpointError(ArchlabError):
    """A missing, truncated or corrupted checkpoint."""


class DiskFull(ArchlabError):
    """No space left on the device being written; what was there before is kept."""


class TrainingDiverged(ArchlabError):
    """The loss became non-finite; the last good checkpoint is kept."""


class UsageError(ArchlabError):
    """A command-line argument out of its range (exit code 2, like argparse's own errors)."""

    exit_code = 2


class OutOfMemory(ArchlabError):
    """The accelerator ran out of memory: a resource limit the user sets (batch size, runs per
    device), not a bug, so it is one line with what to change. Checkpoints already written stay."""


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is torch's out-of-memory error (by name: this module must not import torch,
    and an error from a worker process arrives unpickled as the same type)."""
    return type(e).__name__ == "OutOfMemoryError" or str(e).startswith("CUDA out of memory")
