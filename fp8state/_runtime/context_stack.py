"""The ``fp8_autocast`` stack of each thread, eager and inside graphs that ``torch.compile`` made.

Eager, ``fp8_autocast`` pushes its settings on entry and pops them on exit; the outermost exit
reduces the step's forward amaxes and updates the scales (:func:`push`, :func:`pop`).

A context entered inside a compiled function cannot do so while Dynamo traces: pushing at
trace time would only be replayed after the graph, when its casts have already run. So there
its entry and exit are custom operators of the graph (:func:`compiled_enter`,
:func:`compiled_exit`), which push and pop at runtime, in order: every fp8state operator of a
graph mutates one token tensor, which chains them in program order (and keeps Inductor from
merging or dropping any).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from fp8state._runtime import recompute
from fp8state._runtime.amax_reduction import PendingSteps, reduce_and_update

__all__ = [
    "THREAD",
    "TOKEN",
    "TAGS",
    "push",
    "pop",
    "compiled_enter",
    "compiled_exit",
]

#: Mutated by every fp8state operator of a compiled graph: their order is the program's.
TOKEN = torch.zeros(())
#: Graphs that CUDA graphs replay would skip the operators' Python: Inductor keeps operators
#: with this tag out of them (where the tag exists).
TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[Any] = []  # FP8Contexts, innermost last
        self.fwd_pending: PendingSteps | None = None


THREAD = _ThreadState()
# Contexts entered in compiled graphs, by handle (a graph passes numbers, not objects).
_CONTEXTS: list[Any] = []
_HANDLES: dict[Any, int] = {}


def push(ctx: Any) -> None:
    """Enter ``ctx``; the outermost context of a step (not a recomputation's) collects it."""
    if not THREAD.stack and not recompute.replaying():
        # Outermost: its exit updates the scales. Not in a recomputation, which replays its
        # forward's scales and leaves the pending set None: nothing to update.
        THREAD.fwd_pending = PendingSteps()
    THREAD.stack.append(ctx)


def pop() -> None:
    """Exit the innermost context; the outermost updates the step's forward scales."""
    THREAD.stack.pop()
    if not THREAD.stack:
        pending, THREAD.fwd_pending = THREAD.fwd_pending, None
        if pending is not None and pending.groups:  # not for a step without FP8
            reduce_and_update("fwd", pending)


@torch.compiler.assume_constant_result
def _handle_of(make: type, *fields: Any) -> int:
    # Run at trace time, not traced: the graph keeps the number. Equal settings share one.
    handle = _HANDLES.get(fields)
    if handle is None:
        handle = _HANDLES[fields] = len(_CONTEXTS)
        _CONTEXTS.append(make(*fields))
    return handle


def compiled_enter(ctx: Any, fields: tuple[Any, ...]) -> None:
    """``fp8_autocast.__enter__`` while Dynamo traces: the graph enters ``ctx`` at runtime.

    ``fields``: ``ctx``'s constructor arguments, from which the runtime builds its equal.
    """
    _enter_op(TOKEN, _handle_of(type(ctx), *fields))
    THREAD.stack.append(ctx)  # seen by the trace; balanced by compiled_exit


def compiled_exit() -> None:
    """``fp8_autocast.__exit__`` while Dynamo traces: the graph exits at runtime."""
    THREAD.stack.pop()
    _exit_op(TOKEN)


@torch.library.custom_op(
    "fp8state::autocast_enter",
    mutates_args=("token",),
    tags=TAGS,
    schema="(Tensor(t!) token, int context) -> ()",
)
def _enter_op(token: torch.Tensor, context: int) -> None:
    push(_CONTEXTS[context])


@_enter_op.register_fake
def _enter_fake(token: torch.Tensor, context: int) -> None:
    return None


@torch.library.custom_op(
    "fp8state::autocast_exit",
    mutates_args=("token",),
    tags=TAGS,
    schema="(Tensor(t!) token) -> ()",
)
def _exit_op(token: torch.Tensor) -> None:
    pop()


@_exit_op.register_fake
def _exit_fake(token: torch.Tensor) -> None:
    return None
