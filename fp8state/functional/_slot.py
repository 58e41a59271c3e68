"""One slot's cast of an FP8 module's GEMM, with the module's bookkeeping.

Shared by the eager autograd functions (:mod:`.linear`, :mod:`.mlp`) and by the custom
operator a compiled graph calls instead (:mod:`._ops`), so that both run the same code.
"""

from __future__ import annotations

import torch

from fp8state._runtime import microbatch, norm_cast
from fp8state._runtime.forward_record import ForwardRecord
from fp8state._runtime.friend import CachedWeight
from fp8state._runtime.slot_cast import cast_slot
from fp8state.functional.norm import InputNorm
from fp8state.mixin import FP8StateMixin
from fp8state.slots import Direction, FwdSlot, fwd_slot

__all__ = ["cast_for", "input_cast_for", "weight_for"]


def _buffers(
    module: FP8StateMixin, direction: Direction, replay: ForwardRecord | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """``(history, scale, scale_inv, new_step)`` a cast records into and scales with."""
    if replay is None:
        hist, scale, scale_inv = module.fp8_meta(direction)
        return hist, scale, scale_inv, module.fp8_open_record(direction)
    scales = replay.scales
    assert scales is not None  # records of FP8 calls carry their scales
    return scales.scratch(), scales.scale, scales.scale_inv, False


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
    hist, scale, scale_inv, new_step = _buffers(module, direction, replay)
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


def input_cast_for(
    module: FP8StateMixin,
    slot: int,
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    transpose: bool,
    replay: ForwardRecord | None,
    norm: InputNorm | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, tuple[torch.Tensor, ...]]:
    """A GEMM input's cast (a forward slot); with ``norm``, of ``norm(x)``, computed by it.

    Returns the FP8 copy, its transpose (if asked), the inverse scale and, with a norm, the
    rows' statistics that the norm's backward takes
    (:func:`fp8state._runtime.norm_cast.norm_backward`); without, an empty tuple.
    """
    if norm is None:
        x_fp8, x_fp8_t, inv, _ = cast_for(
            module, "fwd", slot, x, fp8_dtype, transpose, replay=replay
        )
        return x_fp8, x_fp8_t, inv, ()
    hist, scale, scale_inv, new_step = _buffers(module, "fwd", replay)
    return norm_cast.norm_cast_slot(
        x.contiguous(),
        norm.weight,
        norm.bias,
        norm.eps,
        scale,
        scale_inv,
        hist,
        slot,
        fp8_dtype,
        transpose=transpose,
        new_step=new_step,
        rms=norm.rms,
    )


def weight_for(
    module: FP8StateMixin,
    gemm: int,
    weight: torch.Tensor,
    fp8_dtype: torch.dtype,
    transpose: bool,
    is_first_microbatch: bool | None,
) -> tuple[CachedWeight, bool]:
    """The FP8 weight a call multiplies with, and whether it is the cached copy.

    Only a later micro-batch (``is_first_microbatch=False``) reuses
    ``module.fp8_weight_cache[gemm]``, recording nothing, and only a copy that has the layouts
    the call needs (one cast without gradients has no transpose). Every other call casts with
    the slot's scale and records the weight's amax; one that was given
    ``is_first_microbatch`` keeps what it cast in the cache. Inside a ``cast_weights_ahead``
    block, a weight it cast is reused whatever the call was given.
    """
    if microbatch.reuses_ahead(module, gemm):
        is_first_microbatch = False
    cached = module.fp8_weight_cache.get(gemm) if is_first_microbatch is False else None
    if cached is not None and (cached[1] is not None or not transpose):
        return cached, True
    slot = fwd_slot(gemm, FwdSlot.WEIGHT)
    x_fp8, x_fp8_t, inv, _ = cast_for(module, "fwd", slot, weight, fp8_dtype, transpose)
    if is_first_microbatch is not None:
        module.fp8_weight_cache[gemm] = (x_fp8, x_fp8_t, inv)
    return (x_fp8, x_fp8_t, inv), False
