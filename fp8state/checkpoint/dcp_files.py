"""Read a ``torch.distributed.checkpoint`` (DCP) folder in one process, without a model.

For tools (``fp8state inspect``, ``fp8state consolidate``) and for users who want a DCP
checkpoint as a plain state dict. DCP flattens nested dicts on save (a schema-1 extra state,
``blocks.0._extra_state``, became ``blocks.0._extra_state.fwd.scale``, ...); what is read here
is nested again, so every extra state comes back as its module wrote it (schema 2: one tensor).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fp8state.checkpoint._dcp_errors import METADATA_FILE, unreadable_items, unreadable_metadata
from fp8state.checkpoint._metadata_checks import check_coverage, check_fields
from fp8state.checkpoint.dcp_untrusted import (
    AllowListReader,
    load_untrusted_dcp_state_dict,
    read_untrusted_metadata,
)
from fp8state.errors import CheckpointError

__all__ = ["DCPEntry", "is_dcp_checkpoint", "read_dcp_metadata", "load_dcp_state_dict"]


@dataclass(frozen=True)
class DCPEntry:
    """One stored item of a DCP checkpoint, as its metadata describes it (no data read).

    Attributes:
        key: The flat key DCP stored (``"blocks.0._extra_state.fwd.scale"``).
        path: The same key as a path into the nested state dict
            (``("blocks.0._extra_state", "fwd.scale")``).
        shape: The global shape of a tensor; None for a pickled non-tensor item.
        dtype: The tensor's dtype; None for a non-tensor item.
    """

    key: str
    path: tuple[str | int, ...]
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None


def is_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a folder holding a DCP checkpoint (it has a ``.metadata`` file).

    Example:
        >>> import tempfile, torch, torch.distributed.checkpoint as dcp
        >>> from fp8state.checkpoint import is_dcp_checkpoint
        >>> folder = tempfile.mkdtemp()
        >>> is_dcp_checkpoint(folder)
        False
        >>> _ = dcp.save({"w": torch.ones(2)}, checkpoint_id=folder, no_dist=True)
        >>> is_dcp_checkpoint(folder)
        True
    """
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA_FILE))


def _require_dcp(path: str | os.PathLike[str]) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"No such file or directory: {os.fspath(path)!r}")
    if not is_dcp_checkpoint(path):
        raise CheckpointError(
            os.fspath(path),
            "a file" if os.path.isfile(path) else f"a folder without {METADATA_FILE}",
            "a torch.distributed.checkpoint folder",
            "Pass the folder dcp.save wrote; read a torch.save file with fp8state.checkpoint.load.",
        )


def read_metadata(path: str | os.PathLike[str], *, trusted: bool = False) -> Metadata:
    """DCP's :class:`Metadata` of the folder ``path``: through the allow-list, unless trusted."""
    _require_dcp(path)
    if not trusted:
        return read_untrusted_metadata(os.fspath(path))  # coverage checked there too
    try:
        metadata = dcp.FileSystemReader(os.fspath(path)).read_metadata()
    except Exception as err:  # DCP raises assorted pickle/EOF errors for a damaged file
        raise unreadable_metadata(path, err) from err
    check_fields(metadata, path)
    check_coverage(metadata, path)
    return metadata


def read_dcp_metadata(path: str | os.PathLike[str], *, trusted: bool = False) -> list[DCPEntry]:
    """List what a DCP checkpoint stores, reading only its metadata file.

    Args:
        path: The checkpoint folder.
        trusted: Unpickle ``.metadata`` with DCP's own reader (plain pickle). By default it
            goes through the allow-list, which runs nothing from the file.

    Returns:
        One :class:`DCPEntry` per stored item, sorted by key.

    Raises:
        CheckpointError: ``path`` is not a DCP folder or its metadata is damaged.

    Example:
        >>> import tempfile, torch, fp8state
        >>> from fp8state.checkpoint import dcp_save, read_dcp_metadata
        >>> folder = tempfile.mkdtemp()
        >>> _ = dcp_save(torch.nn.Sequential(fp8state.Linear(16, 16)), folder)
        >>> for entry in read_dcp_metadata(folder):
        ...     print(entry.key, entry.path, entry.shape)
        0._extra_state ('0._extra_state',) (5137,)
        0.bias ('0.bias',) (16,)
        0.weight ('0.weight',) (16, 16)
    """
    md = read_metadata(path, trusted=trusted)
    planner_data = md.planner_data if isinstance(md.planner_data, dict) else {}
    entries = []
    for key, item in md.state_dict_metadata.items():
        tensor = item if isinstance(item, TensorStorageMetadata) else None
        entries.append(
            DCPEntry(
                key=key,
                path=tuple(planner_data.get(key, (key,))),
                shape=tuple(tensor.size) if tensor is not None else None,
                dtype=tensor.properties.dtype if tensor is not None else None,
            )
        )
    return sorted(entries, key=lambda e: e.key)


def load_dcp_state_dict(
    path: str | os.PathLike[str], keys: set[str] | None = None, *, trusted: bool = False
) -> dict[str, Any]:
    """Read a DCP checkpoint into one nested state dict of CPU tensors, in this process.

    Works with or without an initialized process group (it never communicates). The whole
    checkpoint is materialized in host memory; pass ``keys`` to read only some entries.

    Args:
        path: The checkpoint folder.
        keys: Top-level keys (``"blocks.0.weight"``, ``"blocks.0._extra_state"``) to read;
            None reads everything.
        trusted: False (the default) runs nothing from the folder: ``.metadata`` and every
            non-tensor item go through allow-lists (:mod:`fp8state.checkpoint.dcp_untrusted`).
            True reads with DCP's own reader, which unpickles them with plain pickle: only
            for folders you trust, holding Python objects the allow-lists refuse.

    Returns:
        The state dict as it was saved: ``_extra_state`` entries are fp8state's flat
        ``dict[str, Tensor]`` again, sharded tensors are whole.

    Raises:
        CheckpointError: ``path`` is not a DCP folder, or reading it failed.
        UnsafeCheckpointError: the folder names a Python global outside the allow-lists
            (nothing was executed; ``trusted=True`` reads it, if you trust it).

    Example:
        >>> import tempfile, torch, torch.distributed.checkpoint as dcp
        >>> from fp8state.checkpoint import load_dcp_state_dict
        >>> folder = tempfile.mkdtemp()
        >>> _ = dcp.save({"w": torch.ones(2), "m._extra_state": {"fwd.scale": torch.ones(3)}},
        ...              checkpoint_id=folder, no_dist=True)
        >>> sorted(load_dcp_state_dict(folder)["m._extra_state"])
        ['fwd.scale']
    """
    _require_dcp(path)
    if not trusted:
        return load_untrusted_dcp_state_dict(path, keys)
    metadata = read_metadata(path, trusted=True)  # every tensor covered, before any read
    try:
        return _load_with_empty_planner(path, keys, metadata)
    except ImportError:
        # _EmptyStateDictLoadPlanner is private; if a torch release drops it, go through the
        # public converter (one extra copy on disk) so reading keeps working.
        if keys is not None:
            raise
        return _load_via_torch_save(path)


def _load_with_empty_planner(
    path: str | os.PathLike[str], keys: set[str] | None, metadata: Metadata
) -> Any:
    # Private but stable: torch's own public dcp_to_torch_save is exactly this call. The
    # public dcp.load cannot do it: it copies the (empty) dict it is given and fills the copy.
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            # The metadata read above (DCP's own reader would unpickle the file again).
            storage_reader=AllowListReader(os.fspath(path), metadata=metadata),
            planner=_EmptyStateDictLoadPlanner(keys=keys),
            no_dist=True,
        )
    except (Exception, CheckpointException) as err:  # the latter is a BaseException
        raise unreadable_items(path, err) from err
    return state


def _load_via_torch_save(path: str | os.PathLike[str]) -> Any:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "consolidated.pt")
        dcp_to_torch_save(path, out)
        return torch.load(out, map_location="cpu", weights_only=True)
