"""The ``fp8_autocast`` stack of each thread, eager and inside graphs that ``torch.compile`` made.

Eager, ``fp8_autocast`` pushes its settings on entry and pops them on exit; the outermost exit
reduces the step's forward amaxes and updates the scales (:func:`push`, :func:`pop`).

A context entered inside a compiled function pushes nothing when the graph runs: the trace
sees it (:func:`compiled_enter`), and the graph refers to it by number
(:func:`context_handle`): each FP8 call's operators carry the number of the context they ran
under, and the exit of the graph's outermost context is one custom operator
(:func:`compiled_exit`) that registers the calls traced inside it and updates their scales,
as an eager exit does. Nothing is left entered on the thread when a graph raises halfway.
A context whose block Dynamo cannot trace whole is entered and exited eagerly instead
(:func:`eager_when_alone`), around the frames Dynamo compiles inside it.
Every fp8state operator of a forward graph mutates one token tensor, which chains them in
program order (the exit after every cast) and keeps Inductor from merging or dropping any.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from fp8state._runtime import handles, recompute
from fp8state._runtime.amax_reduction import PendingSteps, reduce_and_update
from fp8state._runtime.operators import define

__all__ = [
    "THREAD",
    "TOKEN",
    "TAGS",
    "push",
    "pop",
    "compiled_enter",
    "compiled_exit",
    "context_handle",
    "context_of",
    "note_call",
    "eager_when_alone",
]

#: Mutated by every fp8state operator of a compiled forward graph: their order is the
#: program's (a backward graph's casts use a token of their own).
TOKEN = torch.zeros(())
#: Graphs that CUDA graphs replay would skip the operators' Python, and would take the FP8
#: operands the casts make (new memory every step) as static inputs, recorded again at every
#: step: Inductor keeps operators with this tag out of them (where the tag exists).
TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[Any] = []  # FP8Contexts, innermost last
        self.fwd_pending: PendingSteps | None = None
        # While Dynamo traces, per fp8_autocast entered inside the traced function: its
        # number, and the (module, context) numbers of the FP8 calls traced inside it.
        self.handles: list[int] = []
        self.calls: list[list[tuple[torch.Tensor, int]]] = []


THREAD = _ThreadState()
# Every context a graph may refer to, by number (a graph passes numbers, not objects).
_CONTEXTS: list[Any] = []
_HANDLES: dict[Any, int] = {}
_NUMBERING = threading.Lock()  # threads number contexts too


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


def _number(make: type, *fields: Any) -> int:
    """The number graphs know the context ``make(*fields)`` by; equal settings share one."""
    handle = _HANDLES.get(fields)
    if handle is None:
        with _NUMBERING:
            handle = _HANDLES.get(fields)
            if handle is None:
                _CONTEXTS.append(make(*fields))
                handle = _HANDLES[fields] = len(_CONTEXTS) - 1
    return handle


@torch.compiler.assume_constant_result
def _traced_number(make: type, recipe_type: Any, scalars: tuple[Any, ...], *fields: Any) -> int:
    # Run as it is while Dynamo traces, not traced: the graph keeps the number. The recipe
    # comes as its scalars (torch 2.11's Dynamo cannot pass a frozen dataclass to such a
    # function) and the process group as its name (Dynamo passes a stand-in of the object).
    enabled, calibrating, group_name, backend = fields
    recipe = recipe_type.from_scalars(dict(scalars))
    if group_name is None:
        group = None
    else:  # a group exists, so torch.distributed does (not every build has it)
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group_name)
    return _number(make, enabled, calibrating, recipe, group, backend)


def _numbered(ctx: Any) -> int:
    # While Dynamo traces. Fields, not the object: a guard on the object would fail with
    # every new fp8_autocast (a recompilation per step), and Dynamo cannot pass on one it
    # built in the trace.
    recipe, group = ctx.recipe, ctx.group
    scalars = tuple(recipe.to_scalars().items())
    name = None if group is None else group.group_name
    return _traced_number(
        type(ctx), type(recipe), scalars, ctx.enabled, ctx.calibrating, name, ctx.gemm_backend
    )


def context_of(handle: int) -> Any:
    """The context a graph refers to by ``handle``."""
    return _CONTEXTS[handle]


def context_handle(ctx: Any) -> int:
    """While Dynamo traces: the number of the innermost context, ``ctx``, for the graph."""
    if THREAD.handles:  # entered inside the traced function: numbered at its entry
        return THREAD.handles[-1]
    return _numbered(ctx)


def compiled_enter(ctx: Any) -> None:
    """``fp8_autocast.__enter__`` while Dynamo traces."""
    THREAD.stack.append(ctx)  # seen by the trace; balanced by compiled_exit
    THREAD.handles.append(_numbered(ctx))
    THREAD.calls.append([])


def eager_when_alone(*functions: Callable[..., Any]) -> bool:
    """Have Dynamo run ``functions`` eagerly where it meets them as frames of their own.

    Inlined into a traced function, ``fp8_autocast``'s methods are traced (the graph's own
    context, above). Dynamo also meets them alone: it cannot break a graph inside a context
    it traces, so where the ``with`` block holds a graph break, it runs the function holding
    the block eagerly and offers each frame that function calls for compilation, ``__enter__``
    and ``__exit__`` among them. Compiled alone, they would enter a context that no graph
    exits, and an FP8 call run eagerly between them would find no step to register with.
    Skipped, together with what they call, they enter and exit as eager code does, and the
    frames compiled between them register with that context, as graphs called under an
    ``fp8_autocast`` do: the step is an eager step.

    Returns:
        Whether Dynamo took the setting (a private one; torch builds without it keep the
        old behaviour: the eager FP8 call raises ``ConfigError``).
    """
    try:
        frames = importlib.import_module("torch._C._dynamo.eval_frame")
        action = frames._FrameAction.SKIP
        skip = frames._FrameExecStrategy(action, action)  # the frame and what it calls
        for function in functions:
            frames.set_code_exec_strategy(function.__code__, skip)
    except (ImportError, AttributeError, TypeError):
        return False
    return True


def note_call(module: torch.Tensor, context: int) -> bool:
    """While Dynamo traces: an FP8 call of ``module`` under ``context``.

    Returns:
        Whether the call registers itself for the step's update when it runs (a context
        entered before the graph); inside a context of the graph, its exit does.
    """
    if not THREAD.calls:
        return True
    THREAD.calls[-1].append((module, context))
    return False


def compiled_exit() -> None:
    """``fp8_autocast.__exit__`` while Dynamo traces.

    Contexts nest: the outermost context of the graph updates the scales of every call
    traced inside it, or leaves them to a context entered before the graph, as eager
    contexts do.
    """
    THREAD.stack.pop()
    THREAD.handles.pop()
    calls = THREAD.calls.pop()
    if THREAD.calls:
        THREAD.calls[-1].extend(calls)
    elif calls:
        around = bool(THREAD.stack)
        _exit_op(TOKEN, [c[0] for c in calls], [c[1] for c in calls], around)


def _exit(
    token: torch.Tensor, modules: list[torch.Tensor], contexts: list[int], around: bool
) -> None:
    if around:  # an fp8_autocast entered before the graph updates them at its exit
        pending = THREAD.fwd_pending
        if pending is None:  # a recomputation's context: nothing to update
            return
    else:
        pending = PendingSteps()
    for module, context in zip(modules, contexts, strict=True):
        ctx = _CONTEXTS[context]
        pending.add(handles.module_of(module, "fp8state::autocast_exit"), ctx.recipe, ctx.group)
    if not around:
        reduce_and_update("fwd", pending)


def _exit_fake(
    token: torch.Tensor, modules: list[torch.Tensor], contexts: list[int], around: bool
) -> None:
    return None


_exit_op = define(
    "autocast_exit",
    "(Tensor(t!) token, Tensor[] modules, int[] contexts, bool around) -> ()",
    _exit,
    _exit_fake,
    TAGS,
)
