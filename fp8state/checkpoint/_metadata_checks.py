"""Checks of a DCP folder's metadata, made before any item is read.

The fields every reader walks must have the types DCP writes, and every element of every
stored tensor must come from the checkpoint's bytes, exactly once. DCP reads a tensor chunk
by chunk into a tensor the reader allocated (``torch.empty`` when consolidating, the model's
own when loading): elements no chunk covers keep whatever was there, heap garbage or old
weights, and overlapping chunks hide a gap; a tensor whose chunks do not tile it exactly is
refused.
"""

from __future__ import annotations

import math
import os

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from fp8state.checkpoint._dcp_errors import METADATA_FILE
from fp8state.errors import CheckpointError

__all__ = ["check_fields", "check_coverage", "MAX_CHUNKS"]

#: Chunks one tensor may have (each pair is compared for overlap); DCP writes one per rank
#: that holds a shard of it.
MAX_CHUNKS = 4096


def _ints(values: object, n: int) -> tuple[int, ...] | None:
    if not isinstance(values, (tuple, list)) or len(values) != n:
        return None
    if not all(type(v) is int and v >= 0 for v in values):
        return None
    return tuple(values)


def _problem(size: tuple[int, ...], chunks: object) -> str | None:
    if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS:
        return f"{len(chunks) if isinstance(chunks, list) else type(chunks).__name__} chunks"
    boxes = []
    for chunk in chunks:
        offsets = _ints(getattr(chunk, "offsets", None), len(size))
        sizes = _ints(getattr(chunk, "sizes", None), len(size))
        if offsets is None or sizes is None:
            return "a chunk whose offsets or sizes are not its tensor's rank of ints >= 0"
        if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
            return f"a chunk at {offsets} of size {sizes} outside the tensor"
        if math.prod(sizes):
            boxes.append((offsets, sizes))
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != math.prod(size):
        return f"chunks holding {covered} of its {math.prod(size)} elements"
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1 :]:
            if all(
                a0 < b0 + bs and b0 < a0 + as_
                for a0, as_, b0, bs in zip(a_off, a_size, b_off, b_size, strict=True)
            ):
                return f"chunks at {a_off} and {b_off} that overlap"
    return None


def check_fields(metadata: Metadata, folder: str | os.PathLike[str]) -> None:
    """Raise unless the fields every reader walks have the types DCP writes.

    ``state_dict_metadata``: a dict of string keys to tensor or bytes storage metadata;
    ``planner_data``: a dict or None. (``storage_data`` is checked with the storage paths.)

    Raises:
        CheckpointError: naming the field and what it holds.
    """
    where = os.path.join(os.fspath(folder), METADATA_FILE)
    items = metadata.state_dict_metadata
    kinds = (TensorStorageMetadata, BytesStorageMetadata)
    if not isinstance(items, dict):
        found = f"state_dict_metadata of type {type(items).__name__}"
    elif not all(isinstance(k, str) and isinstance(v, kinds) for k, v in items.items()):
        found = "state_dict_metadata holding keys or items DCP does not write"
    elif not isinstance(metadata.planner_data, (dict, type(None))):
        found = f"planner_data of type {type(metadata.planner_data).__name__}"
    else:
        return
    raise CheckpointError(
        where,
        found,
        "DCP's metadata as dcp.save writes it",
        "Nothing was read. The checkpoint is damaged or was crafted; use another.",
    )


def check_coverage(metadata: Metadata, folder: str | os.PathLike[str]) -> None:
    """Raise unless every tensor's chunks tile it exactly, each element once.

    Raises:
        CheckpointError: naming the first tensor whose chunks do not.
    """
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        size = _ints(item.size, len(item.size)) if isinstance(item.size, tuple) else None
        problem = "a size that is not ints >= 0" if size is None else _problem(size, item.chunks)
        if problem is not None:
            raise CheckpointError(
                f"{os.path.join(os.fspath(folder), METADATA_FILE)}: {key}",
                problem,
                "chunks that cover the tensor exactly, each element once",
                "Nothing was read. The checkpoint is damaged or was crafted; use another.",
            )
