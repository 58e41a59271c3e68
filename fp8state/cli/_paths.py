"""The paths a sub-command reads and writes, checked before any work is done.

Each check raises a :class:`~fp8state.errors.CheckpointError` naming the path, what is there and
what the sub-command needs, so the CLI prints one line (and exits 1) instead of an ``OSError``'s
``[Errno 21] Is a directory`` minutes into a conversion.
"""

from __future__ import annotations

import os

from fp8state.checkpoint import is_dcp_checkpoint
from fp8state.errors import CheckpointError

__all__ = ["existing_file", "existing_dcp_folder", "existing_path", "new_file", "refuse_existing"]

#: What a missing path is reported as (also for a dangling symbolic link).
NOTHING_THERE = "no such file or folder"


def _missing(path: str, expected: str) -> CheckpointError:
    return CheckpointError(
        path,
        NOTHING_THERE,
        expected,
        "Check the path (relative paths start from the current directory).",
    )


def existing_path(path: str, expected: str) -> str:
    """``path`` if something is there, file or folder.

    Raises:
        CheckpointError: nothing is at ``path``.
    """
    if not os.path.exists(path):
        raise _missing(path, expected)
    return path


def existing_file(path: str, expected: str, command: str) -> str:
    """``path`` if it is a file (or what a file-like path such as a FIFO leads to).

    Args:
        path: The path given on the command line.
        expected: What it should be, for the message (``"a torch.save file"``).
        command: The sub-command, for the fix of a DCP folder given where a file is expected.

    Raises:
        CheckpointError: nothing is at ``path``, or it is a folder.
    """
    existing_path(path, expected)
    if not os.path.isdir(path):
        return path
    if is_dcp_checkpoint(path):
        raise CheckpointError(
            path,
            "a torch.distributed.checkpoint (DCP) folder",
            expected,
            f"{command} reads one torch.save file: write one with `fp8state consolidate "
            f"{path} OUT.pt` and pass that (`fp8state inspect {path}` reads the folder as it is).",
        )
    raise CheckpointError(path, "a folder", expected, "Pass the checkpoint file itself.")


def existing_dcp_folder(path: str) -> str:
    """``path`` if it is a folder; whether it holds a DCP checkpoint is the reader's to say.

    Raises:
        CheckpointError: nothing is at ``path``, or it is a file.
    """
    expected = "a torch.distributed.checkpoint (DCP) folder, holding .metadata"
    existing_path(path, expected)
    if not os.path.isdir(path):
        raise CheckpointError(
            path,
            "a file",
            expected,
            "A torch.save file is one file already: load it, or `fp8state inspect` it, as it is.",
        )
    return path


def refuse_existing(path: str) -> CheckpointError:
    """The error for an output that exists while ``--overwrite`` was not given."""
    return CheckpointError(
        path,
        "an existing file",
        "a path that does not exist yet",
        "Choose another output path, or add --overwrite to replace it.",
    )


def new_file(path: str, *, overwrite: bool) -> str:
    """``path`` if a file can be written there: a free path, or a file to replace.

    Args:
        path: The output path given on the command line.
        overwrite: Whether ``--overwrite`` was given.

    Raises:
        CheckpointError: ``path`` is a folder, its folder does not exist, or it is an existing
            file and ``overwrite`` is False.
    """
    if os.path.isdir(path):
        raise CheckpointError(
            path,
            "a folder",
            "a file path such as model.pt",
            "Name the file to write, e.g. inside this folder.",
        )
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CheckpointError(
            path,
            "a path in a folder that does not exist",
            "a path in an existing folder",
            f"Create {parent} first, or check the path.",
        )
    if os.path.lexists(path) and not overwrite:
        raise refuse_existing(path)
    return path
