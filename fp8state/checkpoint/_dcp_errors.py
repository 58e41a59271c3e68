"""The errors of reading a DCP folder, shared by the trusted and the allow-list readers."""

from __future__ import annotations

import os

from torch.distributed.checkpoint.api import CheckpointException

from fp8state.errors import CheckpointError

__all__ = ["METADATA_FILE", "unreadable_metadata", "dcp_failure", "unreadable_items"]

METADATA_FILE = ".metadata"  # torch.distributed.checkpoint.filesystem writes this name


def unreadable_metadata(path: str | os.PathLike[str], err: BaseException) -> CheckpointError:
    """The error for a ``.metadata`` file that cannot be unpickled (truncated, corrupt)."""
    return CheckpointError(
        os.path.join(os.fspath(path), METADATA_FILE),
        f"an unreadable metadata file ({type(err).__name__}: {err})",
        "the metadata dcp.save wrote",
        "The checkpoint is incomplete or corrupt.",
    )


def dcp_failure(err: BaseException) -> BaseException:
    """The error behind DCP's ``CheckpointException``, which wraps each rank's one.

    Its own text is many lines (tracebacks included); the CLI prints errors as one line.
    """
    if isinstance(err, CheckpointException):
        return next((cause for cause, _trace in err.failures.values()), err)
    return err


def unreadable_items(path: str | os.PathLike[str], err: BaseException) -> CheckpointError:
    """The error for a failed DCP read, naming the cause (see :func:`dcp_failure`)."""
    err = dcp_failure(err)
    return CheckpointError(
        os.fspath(path),
        f"a checkpoint DCP could not read ({type(err).__name__}: {err})",
        "a complete DCP checkpoint",
        "A shard file (*.distcp) is missing or damaged; copy the whole folder again.",
    )
