"""Save a converted checkpoint atomically, read back with ``torch.load(weights_only=True)``.

The atomic write itself (temporary file, sync, rename or link, the umask's mode) is
:func:`fp8state._atomic_file.write_atomically`; this adds the check that users' own loading
will pass before the file gets its name.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from fp8state._atomic_file import write_atomically
from fp8state.checkpoint.io import refused_global
from fp8state.errors import CheckpointError

__all__ = ["save_atomically"]


def save_atomically(obj: Any, path: str | os.PathLike[str], *, overwrite: bool = True) -> None:
    """``torch.save(obj, path)``, atomically, verified readable with ``weights_only=True``.

    Args:
        obj: What to save.
        path: The file to write.
        overwrite: Replace an existing ``path`` (see :func:`write_atomically`).

    Raises:
        CheckpointError: the result would not load with ``weights_only=True`` (an object in the
            checkpoint outside torch's weights-only set); nothing is written.
        FileExistsError: ``path`` exists and ``overwrite`` is False; nothing is written.
        OSError: the directory is not writable or the disk is full; nothing is written.
    """

    def check(tmp: str) -> None:
        try:
            torch.load(tmp, weights_only=True, map_location="cpu", mmap=True)
        except Exception as err:
            what = refused_global(err) or " ".join(str(err).split())[:160]
            raise CheckpointError(
                os.fspath(path),
                f"a converted checkpoint holding {what}, which torch.load(weights_only="
                "True) refuses",
                "only tensors, plain containers and scalars",
                "Remove that entry (e.g. objects saved beside the state dict) and convert again.",
            ) from None

    write_atomically(path, lambda file: torch.save(obj, file), check=check, overwrite=overwrite)
