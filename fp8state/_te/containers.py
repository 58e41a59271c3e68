"""Open the container TE wrapped its extra state in, whatever the era, without running code.

TE put its extra state into the state dict as a Python list or dict (v0.1-v0.5), a uint8 tensor
of pickle bytes (v0.6-v0.11, v2.x), an ``io.BytesIO`` holding a ``torch.save`` archive
(v0.12-v1.13), ``None`` or an empty tensor (no FP8 state). :func:`open_container` returns the
Python object inside, read through the allow-list unpickler, and the storage location tags seen.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fp8state._te.unpickler import collecting_locations, loads, safe_torch_load
from fp8state.errors import LegacyFormatError

__all__ = ["Opened", "open_container", "LIST", "DICT", "PICKLE", "BYTESIO", "NONE", "EMPTY"]

LIST = "list"
DICT = "dict"
PICKLE = "uint8 pickle"
BYTESIO = "BytesIO archive"
NONE = "None"
#: Prefix of the container of empty tensors: ``"empty tensor (uint8)"``, ``"... (float32)"``.
EMPTY = "empty tensor"


@dataclass(frozen=True)
class Opened:
    """An extra-state value with its container removed.

    Attributes:
        container: One of :data:`LIST`, :data:`DICT`, :data:`PICKLE`, :data:`BYTESIO`,
            :data:`NONE`, :data:`EMPTY`.
        obj: The decoded Python object (None where TE stored no state).
        locations: Location tags of the storages read from nested data (``"cuda:0"``).
        nbytes: Size of the pickle or archive bytes (0 for direct containers).
    """

    container: str
    obj: Any
    locations: frozenset[str] = frozenset()
    nbytes: int = 0


def _uint8_bytes(value: torch.Tensor) -> bytes:
    if value.dim() != 1:
        raise LegacyFormatError(
            "",
            f"a uint8 tensor of shape {tuple(value.shape)}",
            "a 1-D uint8 tensor of pickle bytes",
            "The checkpoint is corrupt.",
        )
    # tolist() is far faster than iterating a storage and needs no numpy.
    return bytes(value.detach().to("cpu").tolist())


def open_container(value: object) -> Opened:
    """Remove TE's container from one ``_extra_state`` value.

    Args:
        value: The value as found in the state dict (after the outer checkpoint was read).

    Returns:
        The container kind and the object inside.

    Raises:
        UnsafeCheckpointError: pickled data names a global outside the allow-list.
        LegacyFormatError: an unknown container, or bytes that cannot be decoded.
    """
    if value is None:
        return Opened(NONE, None)
    if isinstance(value, io.BytesIO):
        # getvalue() reads the whole buffer without moving the caller's position (TE leaves it at
        # the end, PR #363); the object in the state dict stays untouched.
        data = value.getvalue()
        with collecting_locations() as seen:
            obj = safe_torch_load(io.BytesIO(data))
        return Opened(BYTESIO, obj, frozenset(seen), len(data))
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            raise LegacyFormatError(
                "",
                "a tensor on the meta device (it holds no data)",
                "a tensor with data",
                "Load the checkpoint itself, not a state_dict() of a model built on 'meta'.",
            )
        if value.numel() == 0:
            # E09/E10 FP8 off or stateless recipe (uint8); ops-based norms of TE v1.13 (float32).
            kind = "uint8" if value.dtype == torch.uint8 else str(value.dtype).replace("torch.", "")
            return Opened(f"{EMPTY} ({kind})", None)
        if value.dtype != torch.uint8:
            raise LegacyFormatError(
                "",
                f"a {value.dtype} tensor of shape {tuple(value.shape)}",
                "a uint8 tensor of pickle bytes, an empty tensor, io.BytesIO, a list or a dict",
                "This is not a TransformerEngine extra state.",
            )
        data = _uint8_bytes(value)
        with collecting_locations() as seen:
            obj = loads(data)
        return Opened(PICKLE, obj, frozenset(seen), len(data))
    if isinstance(value, list):
        return Opened(LIST, value)
    if isinstance(value, Mapping):
        return Opened(DICT, value)
    raise LegacyFormatError(
        "",
        f"a {type(value).__name__}",
        "a uint8 tensor of pickle bytes, an empty tensor, io.BytesIO, a list, a dict or None",
        "This is not a TransformerEngine extra state.",
    )
