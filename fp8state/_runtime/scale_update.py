"""One direction's scale update from its history: the end of a step, for one module.

The arithmetic of delayed scaling (:func:`fp8state.scaling.update_scale`) written into the
direction's live buffers, by one Triton launch on CUDA and by the pure functions elsewhere
(bit-identical, tests/gpu/test_triton_update.py). Used by ``FP8StateMixin.fp8_update_scales``
and by a compiled ``fp8_autocast``'s exit, which updates the buffers its graph hands it.
"""

from __future__ import annotations

import torch

from fp8state import scaling
from fp8state._runtime.slot_cast import kernels_available
from fp8state.recipe import DelayedScaling
from fp8state.schema import DirectionState
from fp8state.slots import Direction

__all__ = ["update_direction_"]


@torch.no_grad()
def update_direction_(meta: DirectionState, recipe: DelayedScaling, direction: Direction) -> None:
    """Recompute ``meta``'s scale and inverse scale in place from its amax history."""
    window, algo = recipe.amax_history_len, recipe.amax_compute_algo
    fp8_max, margin = recipe.fp8_format.max(direction), recipe.margin
    if kernels_available(meta.scale.device):
        from fp8state._kernels.triton_update import update_scales_

        update_scales_(
            meta.amax_history,
            meta.scale,
            meta.scale_inv,
            window=window,
            algo=algo,
            fp8_max=fp8_max,
            margin=margin,
        )
        return
    scale, scale_inv = scaling.update_scale(
        meta.amax_history, meta.scale, window=window, algo=algo, fp8_max=fp8_max, margin=margin
    )
    meta.scale.copy_(scale)
    meta.scale_inv.copy_(scale_inv)
