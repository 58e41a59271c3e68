"""The names of a module's FP8 metadata buffers: ``fp8_{direction}_{field}``, defined once."""

from __future__ import annotations

from fp8state.schema import DIRECTIONS, TENSOR_FIELDS
from fp8state.slots import Direction

__all__ = ["buffer_name", "BUFFER_NAMES", "ALL_BUFFER_NAMES"]


def buffer_name(direction: Direction, field: str) -> str:
    """The buffer of ``field`` (``"amax_history"``, ``"scale"``, ``"scale_inv"``) of a direction."""
    return f"fp8_{direction}_{field}"


#: Per direction, its three buffers in :data:`fp8state.schema.TENSOR_FIELDS` order.
BUFFER_NAMES: dict[Direction, tuple[str, ...]] = {
    d: tuple(buffer_name(d, f) for f in TENSOR_FIELDS) for d in DIRECTIONS
}
#: All six, forward first: the order of staging blocks and payload keys.
ALL_BUFFER_NAMES: tuple[str, ...] = tuple(n for d in DIRECTIONS for n in BUFFER_NAMES[d])
