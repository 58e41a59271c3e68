"""What :func:`fp8state.recalibrate` saves and puts back of FP8 metadata.

A calibration that fails, or a module that never ran, leaves the model's FP8 metadata as it
was, through the mixin's own apply (so staging and the kernels' tables stay exact). The other
buffers a training-mode forward may change (BatchNorm statistics) go back through
:func:`fp8state._runtime.snapshot.take_buffers`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8state.mixin import FP8StateMixin
from fp8state.schema import DirectionState, FP8State
from fp8state.slots import Direction

__all__ = [
    "Saved",
    "save",
    "restore",
    "reset",
    "with_fwd",
]


@dataclass(frozen=True)
class Saved:
    """One module's FP8 metadata (copies), its recipe and whether its steps were open."""

    state: FP8State
    new_step: dict[Direction, bool]


def save(module: FP8StateMixin) -> Saved:
    live = module.fp8_state()
    copies = [DirectionState(*(t.clone() for t in s)) for s in (live.fwd, live.bwd)]
    return Saved(FP8State(copies[0], copies[1], live.recipe), module._fp8_step_flags())


def restore(module: FP8StateMixin, saved: Saved) -> None:
    # Through the mixin's own apply: it bumps the counters that staging and the kernels'
    # pointer tables rely on, and drops FP8 weights cast with other scales.
    module._fp8_apply(saved.state)
    module._fp8_set_step_flags(saved.new_step)


def _fresh(d: DirectionState) -> DirectionState:
    return DirectionState(
        torch.zeros_like(d.amax_history), torch.ones_like(d.scale), torch.ones_like(d.scale_inv)
    )


def reset(module: FP8StateMixin, directions: tuple[Direction, ...]) -> None:
    """Histories zero and scales 1 in ``directions``, as a freshly built module has."""
    live = module.fp8_state()
    fwd = _fresh(live.fwd) if "fwd" in directions else live.fwd
    bwd = _fresh(live.bwd) if "bwd" in directions else live.bwd
    module._fp8_apply(FP8State(fwd, bwd, live.recipe))


def with_fwd(module: FP8StateMixin, fwd: DirectionState) -> None:
    """Put back forward metadata saved earlier, keeping the live backward metadata."""
    live = module.fp8_state()
    module._fp8_apply(FP8State(fwd, live.bwd, live.recipe))
