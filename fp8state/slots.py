"""FP8 metadata slots, numbered exactly as TransformerEngine numbers them.

Per GEMM ``g`` (0-based) the forward direction has three slots (input, weight, output) and the
backward direction two (grad_output, grad_input). Because the numbering is TE's, migrating a TE
checkpoint is a copy, not a permutation.
"""

from __future__ import annotations

import enum

__all__ = ["FwdSlot", "BwdSlot", "FWD_SLOTS_PER_GEMM", "BWD_SLOTS_PER_GEMM", "fwd_slot", "bwd_slot"]

FWD_SLOTS_PER_GEMM = 3
BWD_SLOTS_PER_GEMM = 2


class FwdSlot(enum.IntEnum):
    """Forward slot of GEMM ``g`` is ``g * FWD_SLOTS_PER_GEMM + role``."""

    INPUT = 0
    WEIGHT = 1
    OUTPUT = 2


class BwdSlot(enum.IntEnum):
    """Backward slot of GEMM ``g`` is ``g * BWD_SLOTS_PER_GEMM + role``."""

    GRAD_OUTPUT = 0
    GRAD_INPUT = 1


def fwd_slot(gemm: int, role: FwdSlot) -> int:
    """Column of the forward metadata for ``role`` of GEMM ``gemm``."""
    return gemm * FWD_SLOTS_PER_GEMM + int(role)


def bwd_slot(gemm: int, role: BwdSlot) -> int:
    """Column of the backward metadata for ``role`` of GEMM ``gemm``."""
    return gemm * BWD_SLOTS_PER_GEMM + int(role)
