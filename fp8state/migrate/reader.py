"""Read a checkpoint file safely onto the CPU and remember where each tensor was saved.

Wraps :func:`fp8state._te.unpickler.safe_torch_load` with the checks torch.load would not
make for us: a truncated zip archive is reported as such, and a TorchScript archive is refused
(torch.load would hand it to ``torch.jit.load``, which runs its code).
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from fp8state._te.unpickler import safe_torch_load
from fp8state.errors import LegacyFormatError, UnsafeCheckpointError

__all__ = ["ReadCheckpoint", "read_checkpoint", "describe_source"]

_ZIP_MAGIC = b"PK\x03\x04"


def describe_source(source: object) -> str:
    """A short name for an error key: the path, or the file object's type."""
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    return getattr(source, "name", None) or f"<{type(source).__name__}>"


@dataclass
class ReadCheckpoint:
    """What :func:`read_checkpoint` returns.

    Attributes:
        obj: The unpickled object, every tensor on the CPU.
        source: The path (or a description of the file object) it came from.
        saved_locations: Storage address -> the location tag it was saved with (``"cuda:0"``).
    """

    obj: Any
    source: str
    saved_locations: dict[int, str] = field(default_factory=dict)

    def location_of(self, tensor: torch.Tensor) -> str | None:
        """The location ``tensor``'s storage was saved with, or None if unknown (empty)."""
        return self.saved_locations.get(tensor.untyped_storage().data_ptr())


def _torch_sees_torchscript(file: IO[bytes], start: int) -> bool:
    """Whether torch.load's own zip reader would dispatch ``file`` to ``torch.jit.load``."""
    file.seek(start)
    try:
        reader = torch._C.PyTorchFileReader(file)
    except RuntimeError:  # unreadable to torch: torch.load fails too, and says so
        return False
    finally:
        file.seek(start)
    return "constants.pkl" in reader.get_all_records()


def _check_archive(file: IO[bytes], name: str) -> None:
    start = file.tell()
    try:
        if file.read(4) != _ZIP_MAGIC:
            return  # legacy (pre-1.6) torch.save format: torch.load reads it
        file.seek(start)
        try:
            with zipfile.ZipFile(file) as archive:
                records = [n.split("/", 1)[-1] for n in archive.namelist()]
        except (zipfile.BadZipFile, EOFError, ValueError) as err:
            raise LegacyFormatError(
                name,
                f"a damaged zip archive ({err})",
                "a complete torch.save archive",
                "The file is truncated or corrupt; copy it again from its source.",
            ) from None
        # torch.load decides with its own reader (miniz), which may read another central
        # directory than Python's zipfile in a crafted archive: ask both.
        if "constants.pkl" in records or _torch_sees_torchscript(file, start):
            raise UnsafeCheckpointError(
                name,
                "a TorchScript archive (torch.load would run it with torch.jit.load)",
                "a torch.save checkpoint",
                "Export a state dict with torch.save(model.state_dict())"
                " from the TorchScript model and migrate that.",
            )
    finally:
        file.seek(start)


def read_checkpoint(source: str | os.PathLike[str] | IO[bytes]) -> ReadCheckpoint:
    """Read a ``torch.save`` file through the allow-list unpickler, onto the CPU.

    Args:
        source: A path or a seekable binary file object.

    Returns:
        The object and the location tag each storage was saved with.

    Raises:
        UnsafeCheckpointError: a global outside the allow-list, or a TorchScript archive.
        LegacyFormatError: the file is truncated, corrupt or not a torch.save file.
        FileNotFoundError, IsADirectoryError, PermissionError: the path cannot be opened.
    """
    name = describe_source(source)
    result = ReadCheckpoint(obj=None, source=name)

    def on_storage(storage: Any, location: str) -> None:
        if storage.nbytes():
            result.saved_locations[storage.data_ptr()] = str(location)

    def load(file: IO[bytes]) -> Any:
        _check_archive(file, name)
        try:
            return safe_torch_load(file, on_storage=on_storage)
        except (LegacyFormatError, UnsafeCheckpointError) as err:
            raise err.under(name) from None

    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as file:
            result.obj = load(file)
    else:
        result.obj = load(source)
    return result
