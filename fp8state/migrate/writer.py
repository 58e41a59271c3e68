"""Write a converted checkpoint atomically: the destination is complete, or untouched.

The file is written next to the destination under a temporary name, flushed to disk, read back
with ``torch.load(weights_only=True)`` (what users will do), and only then renamed over the
destination. Any failure removes the temporary file and leaves no partial destination.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch

from fp8state.checkpoint.io import refused_global
from fp8state.errors import CheckpointError

__all__ = ["save_atomically"]


def save_atomically(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, atomically, verified readable with ``weights_only=True``.

    Raises:
        CheckpointError: the result would not load with ``weights_only=True`` (an object in the
            checkpoint outside torch's weights-only set); nothing is written.
        OSError: the directory is not writable or the disk is full; nothing is written.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        try:
            torch.load(tmp, weights_only=True, map_location="cpu", mmap=True)
        except Exception as err:
            what = refused_global(err) or " ".join(str(err).split())[:160]
            raise CheckpointError(
                path,
                f"a converted checkpoint holding {what}, which torch.load(weights_only="
                "True) refuses",
                "only tensors, plain containers and scalars",
                "Remove that entry (e.g. objects saved beside the state dict) and convert again.",
            ) from None
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
