"""DCP's ``.metadata`` of a folder of unknown origin, read without running anything in it.

The file may name only DCP's metadata classes, sizes, dtypes, layouts and paths (fp8state's
allow-list unpickler with DCP's classes as its allow-list); ``BUILD`` sets only their own
fields. What it says is checked before anything else is opened: every object's fields present
and of the types DCP writes, item bytes inside regular files of the folder, chunks that cover
each tensor exactly.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
from typing import IO, Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata

from fp8state._shown import shown
from fp8state._te.hash_budget import EXPECTED as HASH_EXPECTED
from fp8state._te.unpickler import Unpickler
from fp8state.checkpoint._dcp_errors import METADATA_FILE, unreadable_items, unreadable_metadata
from fp8state.checkpoint._metadata_checks import check_coverage, check_fields
from fp8state.errors import (
    CheckpointError,
    FP8StateError,
    LegacyFormatError,
    UnsafeCheckpointError,
)

__all__ = ["read_untrusted_metadata", "UNTRUSTED_FIX"]

UNTRUSTED_FIX = (
    "Nothing was executed. If you trust this folder, opt into DCP's own reader, which "
    "unpickles it with plain pickle: trusted=True (load_dcp_state_dict, dcp_load, consolidate) "
    "or fp8state consolidate --trusted."
)


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """What ``.metadata`` may name: classes and look-ups that run no code from the file."""
    allowed: dict[tuple[str, str], Any] = {("torch", "Size"): torch.Size}
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    ):
        allowed[(dcp_metadata.__name__, name)] = getattr(dcp_metadata, name)
    # Private names of torch's: a release without them writes no pickle that names them.
    for module, name in (
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # a layout by name, as weights_only allows
    ):
        found = getattr(importlib.import_module(module), name, None)
        if found is not None:
            allowed[(module, name)] = found
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        allowed[("pathlib", name)] = getattr(pathlib, name)  # StorageMeta.checkpoint_id
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    return allowed


_ALLOWED = _allowed_globals()


# The metadata classes whose instances a pickle may give state to (BUILD): DCP's dataclasses.
_STATEFUL = tuple(
    v for v in _ALLOWED.values() if isinstance(v, type) and dataclasses.is_dataclass(v)
)


# Each dataclass's field names, looked up once (a large checkpoint's metadata builds thousands).
_FIELDS: dict[type, frozenset[str]] = {
    cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _STATEFUL
}

# The fields every version of a class required at construction (no default of any kind), and
# those whose default is a factory (not a class attribute an instance without them would read).
_REQUIRED: dict[type, frozenset[str]] = {
    cls: frozenset(
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    for cls in _STATEFUL
}
_FACTORIES: dict[type, tuple[tuple[str, Any], ...]] = {
    cls: tuple(
        (f.name, f.default_factory)
        for f in dataclasses.fields(cls)
        if f.default_factory is not dataclasses.MISSING
    )
    for cls in _STATEFUL
}


def _dataclass_setstate(inst: object, state: object) -> None:
    """``BUILD`` on a DCP metadata object: its own fields, nothing else."""
    if not isinstance(inst, _STATEFUL):
        raise LegacyFormatError(
            "",
            f"a pickle setting the state of a {type(inst).__name__} object",
            "state only for DCP's metadata dataclasses",
            "The checkpoint is corrupt or was crafted; nothing was executed.",
        )
    own = getattr(type(inst), "__setstate__", None)
    if own is not None:  # torch's own (TensorProperties): its fields from a tuple
        own(inst, state)
        return
    names = _FIELDS.get(type(inst), frozenset())  # a subclass: no field may be set
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
    for part in parts:
        if part is None:
            continue
        if not isinstance(part, dict) or not part.keys() <= names:
            what = sorted(part, key=str) if isinstance(part, dict) else part
            raise LegacyFormatError(
                "",
                f"state {shown(what)} for a {type(inst).__name__}",
                f"a dict of its fields {sorted(names)}",
                "The checkpoint is corrupt or was crafted; nothing was executed.",
            )
        # Into the instance dict, as pickle does: frozen dataclasses too.
        vars(inst).update(part)


class _MetadataUnpickler(Unpickler):
    """fp8state's allow-list unpickler with DCP's metadata classes as its allow-list."""

    def __init__(self, file: IO[bytes], key: str) -> None:
        super().__init__(file)
        self._key = key

    def setstate(self, inst: object, state: object) -> None:
        """``BUILD``: fields of DCP's metadata dataclasses only."""
        _dataclass_setstate(inst, state)

    def load(self) -> Any:
        """Unpickle, then complete or refuse each metadata object the pickle left short.

        A pickle can make an instance without running its ``__init__`` (``NEWOBJ`` with no
        ``BUILD``, or a ``BUILD`` that names some fields only): a reader would then meet an
        ``AttributeError`` wherever it first touched a missing field, DCP's own readers
        included. A field with a default reads as that; one with a default factory gets the
        factory's value, as ``__init__`` would give it (a field torch added after the file
        was written); one without either is refused. Only the objects this load made are
        looked at, not the whole tree: metadata holds many more tuples than dataclasses.

        Raises:
            CheckpointError: naming the object's class and its missing fields.
        """
        loaded = super().load()
        for made in self._created.values():
            required = _REQUIRED.get(type(made))  # find_class hands out these exact classes
            if required is None:
                continue
            fields = vars(made)
            for name, factory in _FACTORIES[type(made)]:
                if name not in fields:
                    fields[name] = factory()
            if not required <= fields.keys():
                missing = ", ".join(sorted(required - fields.keys()))
                raise CheckpointError(
                    self._key,
                    f"a {type(made).__name__} without its field(s) {missing}",
                    "DCP's metadata objects with every field, as dcp.save writes them",
                    "Nothing was read. The checkpoint is damaged or was crafted; use another.",
                )
        return loaded

    def find_class(self, module: str, name: str) -> Any:
        """Resolve ``module.name`` from the allow-list; never imports anything."""
        found = _ALLOWED.get((module, name))
        if found is None:
            named = shown(f"{module}.{name}")[1:-1]  # one line, whatever the file holds
            raise UnsafeCheckpointError(
                self._key,
                f"a pickled reference to {named}",
                "only torch.distributed.checkpoint's metadata classes, sizes, dtypes and paths",
                UNTRUSTED_FIX,
            )
        return found


def read_untrusted_metadata(path: str) -> Metadata:
    """DCP's ``Metadata`` of the folder ``path``, unpickled through the allow-list."""
    key = os.path.join(path, METADATA_FILE)
    try:
        with open(key, "rb") as file:
            metadata = _MetadataUnpickler(file, key).load()
    except LegacyFormatError as err:  # a refused BUILD, call or key: name the file
        if err.expected == HASH_EXPECTED:  # a trusting reader would hash it without end
            raise CheckpointError(key, err.found, err.expected, err.fix) from None
        raise UnsafeCheckpointError(key, err.found, err.expected, UNTRUSTED_FIX) from None
    except (FP8StateError, OSError):
        raise
    except Exception as err:  # truncated or random bytes raise anything from EOFError on
        raise unreadable_metadata(path, err) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            key,
            f"a pickled {type(metadata).__name__}",
            "DCP's Metadata object",
            "The checkpoint is corrupt, or the folder was not written by dcp.save.",
        )
    check_fields(metadata, path)
    _check_storage(metadata, path, key)
    check_coverage(metadata, path)
    return metadata


def _check_storage(metadata: Metadata, folder: str, key: str) -> None:
    """Every item's bytes in a regular file inside ``folder``, within its size.

    DCP opens ``folder / relative_path`` and reads ``length`` bytes at ``offset``: a crafted
    ``.metadata`` naming ``/dev/zero``, ``../secret`` or a symbolic link out of the folder
    would read there. Checked before any item file is opened (``os.stat`` opens nothing).
    """
    data = metadata.storage_data
    if not isinstance(data, dict):
        raise CheckpointError(
            key,
            f"storage data of type {type(data).__name__}",
            "a dict of where each item is stored",
            "The checkpoint is corrupt, or the folder was not written by dcp.save.",
        )
    root = os.path.realpath(folder)
    sizes: dict[str, int] = {}
    resolved: dict[object, str | None] = {}  # per file: thousands of items share a few
    for info in data.values():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        # Shown only when refused: even a bounded repr per item costs time on large folders.
        where = (rel, offset, length)
        key_rel = rel if isinstance(rel, str) else id(rel)
        if key_rel not in resolved:
            resolved[key_rel] = _inside(root, rel)
        real = resolved[key_rel]
        if real is None or type(offset) is not int or type(length) is not int:
            raise _outside(key, _item(*where))
        if offset < 0 or length < 0:
            raise _outside(key, _item(*where))
        if real not in sizes:
            if not os.path.lexists(real):  # missing: damaged, as DCP's own reader says
                missing = FileNotFoundError(2, "No such file or directory", real)
                raise unreadable_items(folder, missing)
            if not os.path.isfile(real):  # a folder, a device, a pipe
                raise _outside(key, _item(*where))
            sizes[real] = os.stat(real).st_size
        if offset + length > sizes[real]:
            short = EOFError(f"{real} holds {sizes[real]} bytes, items reach {offset + length}")
            raise unreadable_items(folder, short)


def _item(rel: object, offset: object, length: object) -> str:
    return f"an item stored in {shown(rel)} at offset {shown(offset)}, length {shown(length)}"


def _inside(root: str, rel: object) -> str | None:
    """``root / rel`` resolved, if ``rel`` is a relative path that stays inside ``root``."""
    if not isinstance(rel, str) or rel == "" or "\x00" in rel or os.path.isabs(rel):
        return None
    if ".." in pathlib.PurePath(rel).parts:
        return None
    real = os.path.realpath(os.path.join(root, rel))  # symbolic links followed
    return real if os.path.commonpath([root, real]) == root else None


def _outside(key: str, found: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        key,
        found,
        "bytes of a regular file inside the checkpoint folder",
        "Nothing was opened. The checkpoint was crafted, or its folder holds links out of it.",
    )
