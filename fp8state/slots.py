"""FP8 metadata slots, numbered exactly as TransformerEngine numbers them.

Per GEMM ``g`` (0-based) the forward direction has three slots (input, weight, output) and the
backward direction two (grad_output, grad_input). Because the numbering is TE's, migrating a TE
checkpoint is a copy, not a permutation.
"""

from __future__ import annotations

import enum
from typing import Literal, TypeVar

from fp8state.errors import ConfigError

__all__ = [
    "Direction",
    "DIRECTIONS",
    "by_direction",
    "FwdSlot",
    "BwdSlot",
    "FWD_SLOTS_PER_GEMM",
    "BWD_SLOTS_PER_GEMM",
    "fwd_slot",
    "bwd_slot",
]

#: The two directions of FP8 metadata: forward (GEMM operands and outputs) and backward
#: (gradients).
Direction = Literal["fwd", "bwd"]
#: Both directions, forward first: the order of buffers, payload keys and updates.
DIRECTIONS: tuple[Direction, ...] = ("fwd", "bwd")

_T = TypeVar("_T")


def by_direction(direction: Direction, fwd: _T, bwd: _T) -> _T:
    """``fwd`` or ``bwd``, chosen by ``direction``; any other value is an error.

    Example:
        >>> from fp8state.slots import by_direction
        >>> by_direction("bwd", 3, 2)
        2
    """
    if direction == "fwd":
        return fwd
    if direction == "bwd":
        return bwd
    raise ConfigError(
        "direction", repr(direction), "'fwd' or 'bwd'", "Pass one of fp8state.slots.DIRECTIONS."
    )


FWD_SLOTS_PER_GEMM = 3
BWD_SLOTS_PER_GEMM = 2


class FwdSlot(enum.IntEnum):
    """Forward slot of GEMM ``g`` is ``g * FWD_SLOTS_PER_GEMM + role``.

    Example:
        >>> from fp8state.slots import FwdSlot, fwd_slot
        >>> [(role.name, fwd_slot(1, role)) for role in FwdSlot]
        [('INPUT', 3), ('WEIGHT', 4), ('OUTPUT', 5)]
    """

    INPUT = 0
    WEIGHT = 1
    OUTPUT = 2


class BwdSlot(enum.IntEnum):
    """Backward slot of GEMM ``g`` is ``g * BWD_SLOTS_PER_GEMM + role``.

    Example:
        >>> from fp8state.slots import BwdSlot, bwd_slot
        >>> [(role.name, bwd_slot(1, role)) for role in BwdSlot]
        [('GRAD_OUTPUT', 2), ('GRAD_INPUT', 3)]
    """

    GRAD_OUTPUT = 0
    GRAD_INPUT = 1


def fwd_slot(gemm: int, role: FwdSlot) -> int:
    """Column of the forward metadata for ``role`` of GEMM ``gemm``.

    Example:
        The weight of ``LayerNormMLP``'s fc2 (its GEMM 1):

        >>> from fp8state.slots import FwdSlot, fwd_slot
        >>> fwd_slot(1, FwdSlot.WEIGHT)
        4
    """
    return gemm * FWD_SLOTS_PER_GEMM + int(role)


def bwd_slot(gemm: int, role: BwdSlot) -> int:
    """Column of the backward metadata for ``role`` of GEMM ``gemm``.

    Example:
        The output gradient of ``LayerNormMLP``'s fc2 (its GEMM 1):

        >>> from fp8state.slots import BwdSlot, bwd_slot
        >>> bwd_slot(1, BwdSlot.GRAD_OUTPUT)
        2
    """
    return gemm * BWD_SLOTS_PER_GEMM + int(role)
