"""Tell a safetensors file from everything else before safetensors reads it.

safetensors reports a folder as ``OSError: No such device`` and a JSON index or a
``torch.save`` file as ``header too large``. This module reads the 8-byte header length and
the JSON header itself (the format is in safetensors' ``README.md``), without safetensors
installed, so that fp8state can say what the file is instead, and what to pass.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from fp8state.errors import CheckpointError
from fp8state.schema import EXTRA_STATE_KEY

__all__ = [
    "FP8_METADATA_MARK",
    "read_header",
    "safetensors_header",
    "is_fp8_metadata_header",
    "holds_fp8_metadata",
]

#: Key of the header's ``__metadata__`` that marks the FP8 metadata file save_safetensors writes.
FP8_METADATA_MARK = "fp8state_schema_version"
#: safetensors refuses headers larger than this (100 MB).
_MAX_HEADER = 100_000_000
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTOCOL = b"\x80"
_SHOWN_SHARDS = 3
_FP8_KEY_PART = EXTRA_STATE_KEY + "."  # in every key of a flat FP8 metadata map


def read_header(path: str) -> dict[str, Any] | None:
    """The JSON header of the safetensors file at ``path``, or None when it is not one.

    Raises:
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as file:
        prefix = file.read(8)
        size = os.fstat(file.fileno()).st_size
        if len(prefix) < 8:
            return None
        (length,) = struct.unpack("<Q", prefix)
        if length == 0 or length > _MAX_HEADER or 8 + length > size:
            return None
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # a 200000-deep array included
        return None
    return header if isinstance(header, dict) else None


def is_fp8_metadata_header(header: dict[str, Any]) -> bool:
    """True for the header of the FP8 metadata file :func:`save_safetensors` writes."""
    metadata = header.get("__metadata__")
    return isinstance(metadata, dict) and FP8_METADATA_MARK in metadata


def holds_fp8_metadata(header: dict[str, Any]) -> bool:
    """True for that file, or any whose tensor names look like ``<module>._extra_state.*``."""
    return is_fp8_metadata_header(header) or any(
        _FP8_KEY_PART in key for key in header if key != "__metadata__"
    )


def _index_fix(path: str) -> str | None:
    """The call to make instead, for a Hugging Face ``*.safetensors.index.json``."""
    try:
        with open(path, encoding="utf-8") as file:
            index = json.load(file)
    except (OSError, ValueError):
        return None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return None
    folder = os.path.dirname(path)
    shards = [os.path.join(folder, str(name)) for name in sorted(set(weight_map.values()))]
    shown = ", ".join(repr(s) for s in shards[:_SHOWN_SHARDS])
    more = f", ... ({len(shards)} files)" if len(shards) > _SHOWN_SHARDS else ""
    return (
        f"It is an index; pass the shard file(s) its weight_map lists instead: "
        f"load_safetensors(model, [{shown}{more}])."
    )


def _not_safetensors(path: str) -> CheckpointError:
    with open(path, "rb") as file:
        start = file.read(64)
    expected = "a .safetensors file (an 8-byte header length, then a JSON header)"
    if start.lstrip()[:1] in (b"{", b"["):
        fix = _index_fix(path) or "Pass the .safetensors file(s) it belongs to."
        return CheckpointError(path, "a JSON file, not a safetensors file", expected, fix)
    if start.startswith(_ZIP_MAGIC) or start.startswith(_PICKLE_PROTOCOL):
        return CheckpointError(
            path,
            "a torch.save file, not a safetensors file",
            expected,
            "Read it with fp8state.checkpoint.load(path) and pass the state dict to "
            "fp8state.checkpoint.load_plain_state_dict (weights without FP8 metadata) or "
            "fp8state.checkpoint.load_state_dict (an fp8state checkpoint).",
        )
    return CheckpointError(
        path,
        "a file without a safetensors header (another format, or damaged)",
        expected,
        "Pass a .safetensors file; if this is one, it is truncated or damaged: copy it again.",
    )


def safetensors_header(path: str, argument: str) -> dict[str, Any]:
    """The header of ``path``, or a :class:`CheckpointError` saying what ``path`` is instead.

    Args:
        path: The file.
        argument: The argument it was passed as (``"path"``, ``"fp8_metadata_path"``), for
            the message.

    Raises:
        CheckpointError: ``path`` does not exist, is a folder, cannot be read, or is not a
            safetensors file (a JSON index, a ``torch.save`` file, something else).
    """
    if os.path.isdir(path):
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        inside = f" holding {', '.join(files[:_SHOWN_SHARDS])}" if files else ""
        inside += f", ... ({len(files)} files)" if len(files) > _SHOWN_SHARDS else ""
        raise CheckpointError(
            path,
            f"a folder{inside}",
            f"a .safetensors file as {argument}",
            "Pass the weights file in it, or the list of its shard files (a Hugging Face "
            "model.safetensors.index.json names them); an FP8 metadata file goes to "
            "fp8_metadata_path=.",
        )
    try:
        header = read_header(path)
    except FileNotFoundError:
        raise CheckpointError(
            path,
            "no such file",
            f"a .safetensors file as {argument}",
            "Check the path (relative paths start from the current folder).",
        ) from None
    except OSError as err:
        raise CheckpointError(
            path,
            f"a file that cannot be read ({err.strerror or err})",
            f"a readable .safetensors file as {argument}",
            "Check the file's permissions.",
        ) from None
    if header is None:
        raise _not_safetensors(path)
    return header
