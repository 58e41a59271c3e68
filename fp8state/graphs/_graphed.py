"""A captured module as an autograd node: replay the forward graph, then the backward graph."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fp8state import autocast
from fp8state._runtime import microbatch
from fp8state.errors import ConfigError
from fp8state.graphs._capture import Captured, Graphs, run_under
from fp8state.graphs._checks import (
    ArgSpec,
    FP8Buffers,
    check_args,
    check_context,
    microbatch_flag,
    weights_cached,
)
from fp8state.mixin import FP8StateMixin

__all__ = ["GraphedForward"]


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, graphed: GraphedForward, cap: Captured, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        for static, given in zip(cap.static_inputs, inputs, strict=False):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        cap.fwd_graph.replay()
        graphed.touch()
        graphed.replays += 1
        ctx.graphed, ctx.cap, ctx.replay = graphed, cap, graphed.replays
        # Gradients that must be handed over as copies (see backward): leaves', and those of
        # inputs another replay did not make (they may pass through to a leaf unchanged).
        ctx.leaves = tuple((i, t) for i, t in enumerate(inputs) if t.is_leaf and t.requires_grad)
        ctx.passed_on = tuple(
            i
            for i, t in enumerate(inputs)
            if t.requires_grad
            and not t.is_leaf
            and not isinstance(t.grad_fn, _Replay._backward_cls)
        )
        return tuple(o.detach() for o in cap.static_outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        graphed: GraphedForward = ctx.graphed
        cap: Captured = ctx.cap
        if graphed.replays != ctx.replay:
            # The graphs hold one call's saved state (both kinds of micro-batch share the
            # static inputs and the cached FP8 weights), and a later forward rewrote it.
            raise ConfigError(
                f"graphed callable {graphed.index}, backward",
                f"the backward of forward call {ctx.replay}, after forward call "
                f"{graphed.replays} replayed over its saved state",
                "each call's backward before the module's next forward (one call in flight)",
                "Run backward before calling the module again, or graph one copy of the module "
                "per call in flight (a module called twice in one step: one per call).",
            )
        for static, grad in zip(cap.static_grad_outputs, grads, strict=True):
            if static is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        cap.bwd_graph.replay()
        graphed.touch()
        grads_in = [g.detach() if g is not None else None for g in cap.static_grad_inputs]
        # Autograd keeps a leaf's first gradient as ``.grad`` without copying it; a graph's
        # gradient is its static buffer, which the next replay overwrites, so a second
        # micro-batch would add its gradient to itself. A copy where ``.grad`` is None yet
        # (later accumulations add into ``.grad`` and keep nothing of ours), and for inputs
        # whose backward may pass the buffer on to a leaf (a view, an addition); another
        # replay's backward copies it into its own buffer instead.
        copies = [i for i, leaf in ctx.leaves if leaf.grad is None] + list(ctx.passed_on)
        for i in copies:
            if grads_in[i] is not None:
                grads_in[i] = grads_in[i].clone()
        return (None, None, *grads_in)


class GraphedForward:
    """The forward that replaces a captured module's own while it is in the captured mode.

    In the training mode it was captured in (and with gradients enabled), each call checks its
    arguments and settings, then replays; otherwise it calls the module's original forward,
    which computes the same eagerly (evaluation, inference under ``torch.no_grad()``).

    With FP8 weight caching (``graphs.later`` set), every call takes ``is_first_microbatch``.
    True replays the first micro-batch's graphs and puts their FP8 weight copies in the
    modules' caches; False replays the later micro-batches' graphs, which reuse them, or the
    first one's where the caches are empty (as an eager call casts when it finds none).
    """

    def __init__(
        self,
        index: int,
        module: nn.Module,
        original: Any,
        graphs: Graphs,
        ctx: autocast.FP8Context,
        fp8_modules: list[FP8StateMixin],
        keep_alive: list[Any],
        kwarg_names: tuple[str, ...] = (),
    ) -> None:
        self.index = index
        self.module = module
        self.original = original
        self.graphs = graphs
        self.ctx = ctx
        self.training = module.training
        self.spec = ArgSpec.of(graphs.first.static_inputs)
        self.fp8_modules = fp8_modules
        self.buffers = FP8Buffers(module, fp8_modules)
        self.keep_alive = keep_alive  # pointer tables the graphs read
        # The last static inputs are these keyword arguments' tensors, in this order.
        self.kwarg_names = kwarg_names
        # Forward replays so far: a backward checks that its call was the last.
        self.replays = 0

    def touch(self) -> None:
        """Tell each FP8 module its metadata changed: a replay runs no Python code of theirs."""
        for module in self.fp8_modules:
            module._fp8_touch()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        caching = self.graphs.later is not None
        if self.module.training != self.training or not torch.is_grad_enabled():
            flag = kwargs.pop("is_first_microbatch", None) if caching else None
            with microbatch.assumed(flag):  # an eager call with the flag it was given
                if autocast.innermost_context() is not None:  # the caller's FP8 settings
                    return self.original(*args, **kwargs)
                return run_under(self.ctx, lambda: self.original(*args, **kwargs))
        flag = microbatch_flag(kwargs, caching, self.index)
        if kwargs.keys() != set(self.kwarg_names):
            raise ConfigError(
                f"graphed callable {self.index}",
                f"keyword arguments {sorted(kwargs)}",
                f"those of its sample_kwargs: {sorted(self.kwarg_names)}",
                "Pass the arguments it was captured with: positional ones in order, keyword "
                "ones by name.",
            )
        flat = (*args, *(kwargs[name] for name in self.kwarg_names))
        check_args(self.spec, flat, self.index, self.kwarg_names)
        check_context(self.ctx, self.index)
        self.buffers.check(self.index)
        cap = self.graphs.first
        if flag is False and weights_cached(self.graphs.weights, self.index):
            cap = cast(Captured, self.graphs.later)
        out = _Replay.apply(self, cap, *flat, *cap.params)
        if cap is self.graphs.first:  # its replay wrote the copies later micro-batches reuse
            for module, entries in self.graphs.weights:
                module.fp8_weight_cache.update(entries)
        return pytree.tree_unflatten(list(out), cap.out_spec)
