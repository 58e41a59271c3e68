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

import io
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from fp8state._shown import shown
from fp8state._te.unpickler import safe_torch_load
from fp8state.checkpoint._dcp_errors import (
    METADATA_FILE,
    dcp_failure,
    unreadable_items,
)
from fp8state.checkpoint._dcp_metadata import UNTRUSTED_FIX, read_untrusted_metadata
from fp8state.errors import (
    CheckpointError,
    FP8StateError,
    UnsafeCheckpointError,
)

__all__ = ["load_untrusted_dcp_state_dict", "AllowListReader", "read_untrusted_metadata"]


class AllowListReader(dcp.FileSystemReader):
    """DCP's file reader, with ``.metadata`` read through the allow-list.

    Tensor items are read as DCP reads them (``torch.load(weights_only=True)``); a load that
    asks for non-tensor items must read them through fp8state's unpickler too (the planner
    of :func:`load_untrusted_dcp_state_dict` does; ``dcp_load`` refuses them).

    Args:
        path: The checkpoint folder.
        metadata: What :func:`read_untrusted_metadata` returned for ``path``, when the caller
            has read it already (reading it is most of the cost of opening a large folder).
    """

    def __init__(self, path: str | os.PathLike[str], *, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read ``.metadata`` safely, then stamp it as ``FileSystemReader.read_metadata`` does."""
        metadata = self._metadata or read_untrusted_metadata(os.fspath(self.path))
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
            raise UnsafeCheckpointError(key, err.found, err.expected, UNTRUSTED_FIX) from None
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
            raise TypeError(f"an item inside a {type(node).__name__} at {shown(path)}")
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            present = node[key] is not None
        else:
            present = key in node
        if depth == len(path) - 1:
            if present:  # DCP never stores two items at one path; a crafted file could hide one
                raise TypeError(f"two items at {shown(path)}")
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
            raise _bad_paths(source, ValueError(f"{shown(key)} -> {shown(item_path)}"))
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
                storage_reader=AllowListReader(source, metadata=metadata),
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
