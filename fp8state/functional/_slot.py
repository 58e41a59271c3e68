"""One slot's cast of an FP8 module's GEMM, with the module's bookkeeping.

Shared by the eager autograd functions (:mod:`.linear`, :mod:`.mlp`) and by the custom
operator a compiled graph calls instead (:mod:`._ops`), so that both run the same code.
"""

from __future__ import annotations

import torch

from fp8state._runtime.forward_record import ForwardRecord
from fp8state._runtime.slot_cast import cast_slot
from fp8state.mixin import FP8StateMixin
from fp8state.slots import Direction

__all__ = ["cast_for"]


def cast_for(
    module: FP8StateMixin,
    direction: Direction,
    slot: int,
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    transpose: bool,
    column_sums: bool = False,
    op: str = "identity",
    aux: torch.Tensor | None = None,
    replay: ForwardRecord | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Cast ``x`` with ``slot``'s scale, recording its amax: FP8, transpose, inverse scale.

    ``column_sums`` also returns the column sums from the same pass (a bias gradient);
    ``op``/``aux`` cast a function of ``x`` instead (:func:`fp8state._runtime.slot_cast.cast_slot`).
    ``replay``: a recomputation casts with its forward's scales and records into a scratch
    history, leaving the module's metadata alone.
    """
    if replay is None:
        hist, scale, scale_inv = module.fp8_meta(direction)
        new_step = module.fp8_open_record(direction)
    else:
        scales = replay.scales
        assert scales is not None  # records of FP8 calls carry their scales
        hist, scale, scale_inv, new_step = scales.scratch(), scales.scale, scales.scale_inv, False
    # The inverse scale comes back as a copy: the live one changes when the step ends,
    # before backward runs.
    return cast_slot(
        x.contiguous(),
        scale,
        scale_inv,
        hist,
        slot,
        fp8_dtype,
        transpose=transpose,
        new_step=new_step,
        column_sums=column_sums,
        op=op,
        aux=aux,
    )
