"""``fp8_autocast``: where FP8 compute is on, and when scales update.

Timing, as in TransformerEngine:

1. Inside the context, FP8 modules quantize with their current (delayed) scales and record
   amaxes into row 0 of their histories (:meth:`FP8StateMixin.fp8_record_amax`).
2. When the *outermost* context exits, the forward amaxes of every module that ran are reduced
   over ``fp8_group`` in one collective and the forward scales updated.
3. When the backward pass finishes (an autograd-engine callback queued by the first FP8
   backward of the pass), the same happens for backward, over the group captured at forward.
   A backward pass run from inside another one (a reentrant checkpoint backpropagates its
   recomputed segment so) leaves its update to the outer pass, as if the graph had not
   been checkpointed.
4. A context entered while a forward is recomputed (``fp8_autocast`` inside a checkpointed
   function) changes nothing: the recomputation replays its forward's own context and scales
   (:mod:`fp8state._runtime.recompute`), records nothing, and updates nothing at exit.

The context stack is thread-local (like ``torch.autocast``). The backward registry is shared,
behind a lock, because autograd runs backward on its own threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fp8state._runtime import context_stack
from fp8state._runtime.amax_reduction import PendingSteps, reduce_and_update
from fp8state.backends import BACKENDS
from fp8state.errors import ConfigError
from fp8state.recipe import DelayedScaling

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from fp8state.mixin import FP8StateMixin

__all__ = [
    "fp8_autocast",
    "FP8Context",
    "active_context",
    "innermost_context",
    "is_fp8_enabled",
    "BROKEN_CONTEXTS_RUN_EAGERLY",
]


@dataclass(frozen=True)
class FP8Context:
    """What an ``fp8_autocast`` asked for; modules capture it at forward time."""

    enabled: bool
    calibrating: bool
    recipe: DelayedScaling
    group: ProcessGroup | None
    gemm_backend: str


_THREAD = context_stack.THREAD
# Recipes are frozen: one default instance serves every context (building one per step costs
# host time in a loop that may be launch-bound).
_DEFAULT_RECIPE = DelayedScaling()
# Contexts are frozen too, and a loop enters an equal one every step: building the dataclass
# cost as much host time as entering and leaving it. Keyed by the recipe's identity: the
# cached context holds its recipe, so no other recipe can have that id while the entry
# exists. Contexts with a process group are built each time, so that no group outlives its
# destruction here.
_BUILT: dict[tuple[bool, bool, int, str], FP8Context] = {}
_BUILT_MAX = 64


def _context(
    enabled: bool,
    calibrating: bool,
    recipe: DelayedScaling,
    group: ProcessGroup | None,
    gemm_backend: str,
) -> FP8Context:
    """The context for these settings, shared with earlier equal ones where it can be."""
    if group is not None or torch.compiler.is_compiling():  # traced: no global state
        return FP8Context(enabled, calibrating, recipe, group, gemm_backend)
    key = (enabled, calibrating, id(recipe), gemm_backend)
    ctx = _BUILT.get(key)
    if ctx is None:
        if len(_BUILT) >= _BUILT_MAX:  # a loop building a recipe per step
            _BUILT.clear()
        ctx = _BUILT[key] = FP8Context(enabled, calibrating, recipe, None, gemm_backend)
    return ctx


class _BackwardRegistry:
    """Modules whose backward recorded amaxes in the running backward pass."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending = PendingSteps()
        # Backward passes (autograd graph tasks) with a flush queued. Per pass, not one flag:
        # a pass that raises never runs its final callbacks, and a single flag would then stay
        # set forever, so no later backward would ever update its scales.
        self.queued_tasks: set[int] = set()
        # Passes that recompute a checkpointed forward: their flush is queued, and the passes
        # run from inside them (reentrant checkpoints) leave the update to them.
        self.holding: set[int] = set()

    def register(self, module: FP8StateMixin, ctx: FP8Context) -> None:
        task = torch._C._current_graph_task_id()
        with self.lock:
            self.pending.add(module, ctx.recipe, ctx.group)
            queue = task not in self.queued_tasks
            self.queued_tasks.add(task)
        if queue:
            self._queue_flush(task)

    def hold(self, task: int) -> None:
        with self.lock:
            if task in self.holding:
                return
            self.holding.add(task)
            queue = task not in self.queued_tasks
            self.queued_tasks.add(task)
        if queue:
            self._queue_flush(task)

    def _queue_flush(self, task: int) -> None:
        # Runs once the whole backward pass is done, whatever the graph's shape.
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self.flush(task))

    def flush(self, task: int | None = None) -> None:
        nested = task is not None and torch._C._current_autograd_node() is not None
        with self.lock:
            if task is not None:
                self.queued_tasks.discard(task)
            if nested and self.holding - {task}:
                # A pass run from inside a node of a pass that recomputes (a reentrant
                # checkpoint's): that pass updates once at its end, as without checkpoints.
                return
            if nested:
                self.holding.discard(task)
            else:
                # No pass runs on this thread any more. Holds of passes that raised (their
                # callbacks never ran) go too; concurrent passes on other threads already
                # share one update (the registry is process-wide).
                self.holding.clear()
            pending, self.pending = self.pending, PendingSteps()
        reduce_and_update("bwd", pending)


_BACKWARD = _BackwardRegistry()


def active_context() -> FP8Context | None:
    """The innermost ``fp8_autocast`` if it enables FP8 compute or calibration, else None."""
    stack = _THREAD.stack
    if stack and (stack[-1].enabled or stack[-1].calibrating):
        return stack[-1]
    return None


def innermost_context() -> FP8Context | None:
    """The innermost ``fp8_autocast``'s settings, whatever they enable; None outside any."""
    stack = _THREAD.stack
    return stack[-1] if stack else None


def is_fp8_enabled() -> bool:
    """True inside an ``fp8_autocast(enabled=True)`` (TE's ``is_fp8_enabled``)."""
    ctx = active_context()
    return ctx is not None and ctx.enabled


def register_forward(module: FP8StateMixin, ctx: FP8Context) -> None:
    """Note that ``module`` recorded forward amaxes in the current outermost context."""
    pending = _THREAD.fwd_pending
    if pending is None:  # only inside a compiled fp8_autocast that Dynamo broke up
        raise ConfigError(
            f"{type(module).__name__}",
            "an FP8 call run eagerly inside an fp8_autocast entered in a compiled function "
            "(a graph break inside the context)",
            "the compiled function traced whole, or the fp8_autocast entered around it",
            "Compile with fullgraph=True to find the break, or enter fp8_autocast outside the "
            "compiled function.",
        )
    pending.add(module, ctx.recipe, ctx.group)


def register_backward(module: FP8StateMixin, ctx: FP8Context) -> None:
    """Note that ``module`` recorded backward amaxes in the running backward pass."""
    _BACKWARD.register(module, ctx)


def hold_backward_update() -> None:
    """Note that a forward is recomputed in the running backward pass.

    The pass's backward scale update then waits for its end, also for the backward passes run
    from inside it (a reentrant checkpoint backpropagates its recomputed segment in one).
    """
    task = torch._C._current_graph_task_id()
    if task != -1:  # a drop-in scope replaying outside backward has no pass to hold
        _BACKWARD.hold(task)


class fp8_autocast:  # noqa: N801 - TE's name, a context manager used like a function
    """Enable FP8 compute for fp8state modules in the ``with`` body.

    Args:
        enabled: Compute GEMMs in FP8. ``False`` (or outside any context) means every module
            computes exactly what its high-precision PyTorch counterpart computes.
        calibrating: Record amaxes (and update scales at exit) while computing in high
            precision; backward records nothing.
        fp8_recipe: The recipe; default ``DelayedScaling()``.
        fp8_group: Process group over which amaxes are reduced (max) at the end of the step.
            ``None`` means the default group when ``torch.distributed`` is initialized, as in
            TE; nothing is reduced in a single process.
        gemm_backend: ``"auto"`` (``torch._scaled_mm`` where the device supports FP8 GEMMs,
            the emulation elsewhere), ``"emulated"`` (force emulation) or ``"scaled_mm"``
            (fail where it cannot run).

    Contexts nest; each restores the previous state on exit, also when the body raises.
    Scales update only when the outermost context exits.

    Example:
        >>> import torch, fp8state
        >>> layer = fp8state.Linear(16, 16)
        >>> with fp8state.fp8_autocast(fp8_recipe=fp8state.DelayedScaling(amax_history_len=4)):
        ...     y = layer(torch.randn(4, 16))
        >>> bool(layer.fp8_meta("fwd").amax_history[0, 0] > 0)
        True
    """

    __slots__ = ("_ctx", "_entered")

    def __init__(
        self,
        enabled: bool = True,
        calibrating: bool = False,
        fp8_recipe: DelayedScaling | None = None,
        fp8_group: ProcessGroup | None = None,
        *,
        gemm_backend: str = "auto",
    ) -> None:
        if fp8_recipe is not None and not isinstance(fp8_recipe, DelayedScaling):
            raise ConfigError(
                "fp8_autocast(fp8_recipe=...)",
                type(fp8_recipe).__name__,
                "an fp8state.DelayedScaling",
                "Build the recipe with fp8state.DelayedScaling.",
            )
        if gemm_backend not in BACKENDS:
            raise ConfigError(
                "fp8_autocast(gemm_backend=...)",
                repr(gemm_backend),
                f"one of {BACKENDS}",
                "Pass gemm_backend='auto'.",
            )
        self._ctx = _context(
            bool(enabled), bool(calibrating), fp8_recipe or _DEFAULT_RECIPE, fp8_group, gemm_backend
        )
        self._entered = False

    def __enter__(self) -> fp8_autocast:
        if self._entered:
            raise ConfigError(
                "fp8_autocast",
                "a context entered twice",
                "one `with` per instance",
                "Create a new fp8_autocast(...) for each `with` block.",
            )
        self._entered = True
        if torch.compiler.is_compiling():  # traced: graphs know contexts by number
            context_stack.compiled_enter(self._ctx)
        else:
            context_stack.push(self._ctx)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            if torch.compiler.is_compiling():
                context_stack.compiled_exit()
            else:
                context_stack.pop()
        finally:
            self._entered = False


#: Whether a context whose ``with`` block Dynamo breaks up enters and exits eagerly (so the
#: FP8 calls run eagerly inside it are an eager step's) rather than refusing those calls.
BROKEN_CONTEXTS_RUN_EAGERLY = context_stack.eager_when_alone(
    fp8_autocast.__init__, fp8_autocast.__enter__, fp8_autocast.__exit__
)
