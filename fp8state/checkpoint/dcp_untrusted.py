"""Read a DCP folder of unknown origin without running anything pickled in it.

DCP's own reader unpickles the ``.metadata`` file with plain :mod:`pickle` and each non-tensor
item with ``torch.load(weights_only=False)``: a crafted folder runs code the moment it is read.
Here ``.metadata`` may name only DCP's metadata classes, sizes, dtypes, layouts and paths, and
non-tensor items go through fp8state's allow-list unpickler (:mod:`fp8state._te.unpickler`,
the one that reads TransformerEngine files). Tensor items are read by DCP itself, which already
uses ``torch.load(weights_only=True)`` for them. Every DCP reader of fp8state (and so every
command of the CLI) reads folders this way unless called with ``trusted=True``.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import os
import pathlib
import warnings
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from fp8state._te.unpickler import Unpickler, safe_torch_load
from fp8state.checkpoint._dcp_errors import (
    METADATA_FILE,
    dcp_failure,
    unreadable_items,
    unreadable_metadata,
)
from fp8state.checkpoint._metadata_checks import check_coverage, check_fields
from fp8state.errors import (
    CheckpointError,
    FP8StateError,
    LegacyFormatError,
    UnsafeCheckpointError,
)

__all__ = ["load_untrusted_dcp_state_dict", "AllowListReader", "read_untrusted_metadata"]

_FIX = (
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
        if not isinstance(part, dict) or not all(k in names for k in part):
            shown = ascii(sorted(map(str, part)) if isinstance(part, dict) else part)[:120]
            raise LegacyFormatError(
                "",
                f"state {shown} for a {type(inst).__name__}",
                f"a dict of its fields {sorted(names)}",
                "The checkpoint is corrupt or was crafted; nothing was executed.",
            )
        for name, value in part.items():
            object.__setattr__(inst, name, value)  # frozen dataclasses too, as pickle does


class _MetadataUnpickler(Unpickler):
    """fp8state's allow-list unpickler with DCP's metadata classes as its allow-list."""

    def __init__(self, file: IO[bytes], key: str) -> None:
        super().__init__(file)
        self._key = key

    def setstate(self, inst: object, state: object) -> None:
        """``BUILD``: fields of DCP's metadata dataclasses only."""
        _dataclass_setstate(inst, state)

    def find_class(self, module: str, name: str) -> Any:
        """Resolve ``module.name`` from the allow-list; never imports anything."""
        found = _ALLOWED.get((module, name))
        if found is None:
            shown = ascii(f"{module}.{name}")[1:-1][:120]  # one line, whatever the file holds
            raise UnsafeCheckpointError(
                self._key,
                f"a pickled reference to {shown}",
                "only torch.distributed.checkpoint's metadata classes, sizes, dtypes and paths",
                _FIX,
            )
        return found


def read_untrusted_metadata(path: str) -> Metadata:
    """DCP's ``Metadata`` of the folder ``path``, unpickled through the allow-list."""
    key = os.path.join(path, METADATA_FILE)
    try:
        with open(key, "rb") as file:
            metadata = _MetadataUnpickler(file, key).load()
    except LegacyFormatError as err:  # a refused BUILD or call: name the file
        raise UnsafeCheckpointError(key, err.found, err.expected, _FIX) from None
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
        shown = f"an item stored in {ascii(rel)[:120]} at offset {offset!r}, length {length!r}"
        key_rel = rel if isinstance(rel, str) else id(rel)
        if key_rel not in resolved:
            resolved[key_rel] = _inside(root, rel)
        real = resolved[key_rel]
        if real is None or type(offset) is not int or type(length) is not int:
            raise _outside(key, shown[:300])
        if offset < 0 or length < 0:
            raise _outside(key, shown[:300])
        if real not in sizes:
            if not os.path.lexists(real):  # missing: damaged, as DCP's own reader says
                missing = FileNotFoundError(2, "No such file or directory", real)
                raise unreadable_items(folder, missing)
            if not os.path.isfile(real):  # a folder, a device, a pipe
                raise _outside(key, shown[:300])
            sizes[real] = os.stat(real).st_size
        if offset + length > sizes[real]:
            short = EOFError(f"{real} holds {sizes[real]} bytes, items reach {offset + length}")
            raise unreadable_items(folder, short)


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


class AllowListReader(dcp.FileSystemReader):
    """DCP's file reader, with ``.metadata`` read through the allow-list.

    Tensor items are read as DCP reads them (``torch.load(weights_only=True)``); a load that
    asks for non-tensor items must read them through fp8state's unpickler too (the planner
    of :func:`load_untrusted_dcp_state_dict` does; ``dcp_load`` refuses them).
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read ``.metadata`` safely, then stamp it as ``FileSystemReader.read_metadata`` does."""
        metadata = read_untrusted_metadata(os.fspath(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _AllowListPlanner(DefaultLoadPlanner):
    """Loads into a flat template; non-tensor items through fp8state's allow-list unpickler."""

    def __init__(self, source: str) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._source = source

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickle one non-tensor item without running code (tensors land on the CPU)."""
        fqn = read_item.dest_index.fqn
        key = f"{self._source}/{fqn}"
        try:
            self.state_dict[fqn] = safe_torch_load(value)
        except UnsafeCheckpointError as err:
            raise UnsafeCheckpointError(key, err.found, err.expected, _FIX) from None
        except FP8StateError as err:  # undecodable bytes, as DCP's reader would fail on them
            raise CheckpointError(
                key,
                err.found,
                "an item as dcp.save wrote it",
                "A shard file (*.distcp) is damaged; copy the whole folder again.",
            ) from None


def _set_element(root: dict[Any, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in nested dicts and lists, as DCP unflattens (int -> list).

    Raises:
        TypeError: the path runs through a value, or another item is already there.
    """
    node: Any = root
    for depth, key in enumerate(path):
        if not isinstance(node, (dict, list)):
            raise TypeError(f"an item inside a {type(node).__name__} at {path!r}"[:160])
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            present = node[key] is not None
        else:
            present = key in node
        if depth == len(path) - 1:
            if present:  # DCP never stores two items at one path; a crafted file could hide one
                raise TypeError(f"two items at {path!r}"[:160])
            node[key] = value
        else:
            if not present:
                node[key] = [] if isinstance(path[depth + 1], int) else {}
            node = node[key]


def _bad_paths(source: str, err: Exception) -> CheckpointError:
    return CheckpointError(
        os.path.join(source, METADATA_FILE),
        f"item paths that do not nest ({type(err).__name__}: {err})"[:300],
        "the paths dcp.save recorded",
        "The checkpoint is corrupt or was crafted.",
    )


def _item_paths(metadata: Metadata, source: str) -> dict[str, tuple[str | int, ...]]:
    """Each stored key's path into the nested state dict (DCP's ``planner_data``), checked."""
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    count = len(metadata.state_dict_metadata)
    out = {}
    for key in metadata.state_dict_metadata:
        item_path = planner_data.get(key, (key,))
        # A list index is below the item count: DCP stores every element of a list.
        ok = (
            isinstance(item_path, (tuple, list))
            and len(item_path) > 0
            and all(isinstance(p, str) or (type(p) is int and 0 <= p < count) for p in item_path)
        )
        if not ok:
            raise _bad_paths(source, ValueError(f"{key!r} -> {item_path!r}"))
        out[key] = tuple(item_path)
    return out


def load_untrusted_dcp_state_dict(
    path: str | os.PathLike[str], keys: set[str] | None = None
) -> dict[str, Any]:
    """Read a DCP folder as ``load_dcp_state_dict`` does, but run nothing pickled in it.

    1. ``.metadata`` is unpickled through an allow-list of DCP's metadata classes.
    2. A flat template (an empty CPU tensor per tensor item, a placeholder per other item) is
       filled by ``dcp.load``: tensors by DCP, other items by fp8state's allow-list unpickler.
    3. Nested dicts and lists are rebuilt from DCP's ``planner_data`` paths.

    Args:
        path: The checkpoint folder (``load_dcp_state_dict`` checked that it is one).
        keys: Top-level keys to read; None reads everything.

    Returns:
        The nested state dict as it was saved, every tensor on the CPU.

    Raises:
        UnsafeCheckpointError: ``.metadata`` or an item names a global outside the allow-lists;
            nothing was executed.
        CheckpointError: ``.metadata`` is damaged, or an item could not be read.
    """
    source = os.fspath(path)
    metadata = read_untrusted_metadata(source)
    item_paths = _item_paths(metadata, source)
    flat: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if keys is not None and item_paths[key][0] not in keys:
            continue
        if isinstance(item, TensorStorageMetadata):
            flat[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            flat[key] = None  # replaced by _AllowListPlanner.load_bytes
    try:
        with warnings.catch_warnings():
            # DCP warns it "assumes a single process" even when told so with no_dist=True.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                flat,
                storage_reader=AllowListReader(source),
                planner=_AllowListPlanner(source),
                no_dist=True,
            )
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        cause = dcp_failure(err)
        if isinstance(cause, FP8StateError):  # raised by the allow-lists above
            raise cause from None
        raise unreadable_items(source, cause) from err
    state: dict[str, Any] = {}
    try:
        for key, value in flat.items():
            _set_element(state, item_paths[key], value)
    except (TypeError, IndexError) as err:  # paths that clash (one item inside another)
        raise _bad_paths(source, err) from None
    return state
