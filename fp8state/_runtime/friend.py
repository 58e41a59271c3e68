"""The friend interface: what fp8state's runtime may ask of an FP8 module, and nothing more.

:class:`fp8state.FP8StateMixin` implements it: its public metadata accessors, its
``_fp8_has_meta`` and the step bookkeeping of :class:`StepBookkeeping`, which it inherits. The
runtime modules (staging, payload I/O, amax reduction) are typed against :class:`FP8Friend`,
so they never import the mixin and never touch its private attributes; recalibration, above
the mixin, uses the same ``_fp8_*`` methods. Users need none of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import torch

from fp8state.recipe import DelayedScaling
from fp8state.schema import DirectionState
from fp8state.slots import DIRECTIONS, Direction

__all__ = ["CachedWeight", "FP8Friend", "StepBookkeeping", "close_steps", "set_plain_attr"]

#: A cached FP8 weight (``is_first_microbatch``): the FP8 copy, its transpose (None where it
#: was cast without one) and its inverse scale.
CachedWeight = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]


def set_plain_attr(module: object, name: str, value: object) -> None:
    """``module.name = value`` for a plain attribute, bypassing ``nn.Module.__setattr__``.

    ``nn.Module.__setattr__`` looks ``name`` up among parameters, buffers and submodules first,
    a cost paid per cast and per step on the hot path; the attributes set here are none of
    those, so writing the instance dict is the same assignment.
    """
    module.__dict__[name] = value


class FP8Friend(Protocol):
    """An FP8 module as the runtime sees it (implemented by ``FP8StateMixin``)."""

    _buffers: dict[str, torch.Tensor | None]
    fp8_recipe: DelayedScaling
    fp8_weight_cache: dict[int, CachedWeight]

    @property
    def fp8_num_gemms(self) -> int:
        """GEMMs declared in ``init_fp8_meta``."""
        ...

    def fp8_meta(self, direction: Direction) -> DirectionState:
        """The live buffers of ``direction``."""
        ...

    def fp8_update_scales(self, direction: Direction, recipe: DelayedScaling | None = None) -> None:
        """Recompute ``direction``'s scales from its history (one module at a time)."""
        ...

    def _fp8_has_meta(self) -> bool:
        """Whether ``init_fp8_meta`` ran (a subclass may not have called it yet)."""
        ...

    def _fp8_mutation_count(self) -> int:
        """A counter that every change of the metadata through the module bumps."""
        ...

    def _fp8_touch(self) -> None:
        """Count a change of the metadata made outside the module (a kernel's write)."""
        ...

    def _fp8_close_step(self, direction: Direction) -> None:
        """Mark ``direction``'s scales updated: the next record opens a new step."""
        ...

    def _fp8_step_flags(self) -> dict[Direction, bool]:
        """Per direction, whether the next record opens a new step (a copy)."""
        ...

    def _fp8_opens_step(self, direction: Direction) -> bool:
        """Whether ``direction``'s next record opens a new step (nothing recorded since)."""
        ...

    def _fp8_continue_step(self, direction: Direction) -> None:
        """The next record max-combines into row 0 instead of opening a new step."""
        ...

    def _fp8_set_step_flags(self, flags: Mapping[Direction, bool]) -> None:
        """Set, per direction, whether the next record opens a new step."""
        ...

    def _fp8_reset_steps(self) -> None:
        """Forget open steps in both directions (after a load or a reset) and cached weights."""
        ...


class StepBookkeeping:
    """The friend interface's step bookkeeping, mixed into ``FP8StateMixin``.

    Two pieces of state, both set by ``init_fp8_meta``: ``_fp8_new_step`` (per direction,
    whether the next amax record opens a new step: shifts the history down one row) and
    ``_fp8_mutations`` (bumped by every change of the metadata through the module, so a staged
    payload knows when it is stale). Plain attributes, written to the instance dict
    (:func:`set_plain_attr` says why).
    """

    _fp8_mutations: int
    _fp8_new_step: dict[Direction, bool]
    fp8_weight_cache: dict[int, CachedWeight]

    def _fp8_mutation_count(self) -> int:
        return self._fp8_mutations

    # Runs per cast: it writes the instance dict itself, with no nested call (set_plain_attr
    # says why the dict is the same); close_steps does the same for the end of a step.
    def _fp8_touch(self) -> None:
        self.__dict__["_fp8_mutations"] += 1

    def _fp8_close_step(self, direction: Direction) -> None:
        close_steps((self,), direction)

    def _fp8_continue_step(self, direction: Direction) -> None:
        """The next record max-combines into row 0 instead of opening a new step."""
        self._fp8_new_step[direction] = False

    def _fp8_step_flags(self) -> dict[Direction, bool]:
        """Per direction, whether the next record opens a new step (a copy)."""
        return dict(self._fp8_new_step)

    def _fp8_opens_step(self, direction: Direction) -> bool:
        return self.__dict__["_fp8_new_step"][direction]

    def _fp8_set_step_flags(self, flags: Mapping[Direction, bool]) -> None:
        set_plain_attr(self, "_fp8_new_step", {d: bool(flags[d]) for d in DIRECTIONS})

    def _fp8_reset_steps(self) -> None:
        set_plain_attr(self, "_fp8_new_step", {d: True for d in DIRECTIONS})
        self.fp8_weight_cache.clear()  # FP8 weights were cast with the old scales


def close_steps(modules: Iterable[object], direction: Direction) -> None:
    """``_fp8_close_step(direction)`` of every module, in one loop without a call per module.

    The end of a step closes every module that recorded in it (thousands in a large model), so
    the loop writes each instance dict itself: a method call per module doubled the host time
    of a 1000-module scale update's bookkeeping. ``modules`` are :class:`StepBookkeeping`'s.
    """
    for module in modules:
        state = module.__dict__
        state["_fp8_new_step"][direction] = True
        state["_fp8_mutations"] += 1
