"""A GEMM that fell back to high precision, still taking part in the ranks' amax reductions.

The end of a step concatenates row 0 of every registered module's history, in execution
order, into one all-reduce per direction (:mod:`fp8state._runtime.amax_reduction`), so every
rank of the group must register the same modules in the same order. Whether a GEMM runs in
FP8 depends on its size, tokens included (``fp8_min_gemm_macs``), and data-parallel ranks may
see batches of different lengths (each padded to its own longest sequence): one rank may run
a module's GEMM in FP8 while another falls back. So under a group of several ranks, a call
that falls back registers its module as an FP8 call would, forward at the call and backward
when the output's gradient arrives, without recording; the reduction opens the step of a
module that recorded nothing with a zero row, the neutral element of its MAX. Every rank then
reduces the same modules in the same order, the module's history gains the max over the
ranks that ran it in FP8 (a zero row where none did) and its scales stay identical on every
rank.

Not for graphed modules: a CUDA graph replays the shapes it captured, the same on every rank.
Without a group of several ranks a fallback touches no metadata.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8state import autocast
from fp8state._runtime import context_stack
from fp8state._runtime.amax_reduction import should_reduce
from fp8state._runtime.context_stack import TAGS, TOKEN, context_of
from fp8state._runtime.operators import define
from fp8state.functional._ops import _forward, _module
from fp8state.mixin import FP8StateMixin

__all__ = ["takes_part", "forward", "replayed", "compiled"]


def takes_part(module: FP8StateMixin, ctx: autocast.FP8Context) -> bool:
    """Whether a fallback of ``module`` under ``ctx`` must still join the reductions."""
    return ctx.enabled and not module.fp8_graphed and should_reduce(ctx.group)


def forward(module: FP8StateMixin, ctx: autocast.FP8Context, out: torch.Tensor) -> torch.Tensor:
    """``out`` of an eager fallback: the module joins this step's reductions, both ways."""
    autocast.register_forward(module, ctx)
    return _TakePart.apply(out, module, ctx)


def replayed(module: FP8StateMixin, ctx: autocast.FP8Context, out: torch.Tensor) -> torch.Tensor:
    """``out`` of a fallback recomputed by activation checkpointing: the backward part only.

    A reentrant checkpoint backpropagates through the recomputed graph, so the backward part
    of the call lives there, as an FP8 call's does; its forward took part already.
    """
    return _TakePart.apply(out, module, ctx)


def compiled(handle: torch.Tensor, context: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` of a fallback in a graph being compiled: both parts, as operators."""
    register = context_stack.note_call(handle, context)
    take_part_op(handle, context, register, TOKEN)
    return _CompiledTakePart.apply(out, handle, context)


class _TakePart(torch.autograd.Function):
    """The identity; its backward joins the backward reduction."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, out: torch.Tensor, module: FP8StateMixin, fp8_ctx: autocast.FP8Context
    ) -> torch.Tensor:
        ctx.module, ctx.fp8_ctx = module, fp8_ctx
        # Detached, not ``out`` itself: autograd makes an input returned as it is a view, and
        # refuses in-place ops on it (an ``inplace=True`` activation after the layer).
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        autocast.register_backward(ctx.module, ctx.fp8_ctx)
        return grad, None, None


class _CompiledTakePart(torch.autograd.Function):
    """:class:`_TakePart` for a compiled graph: its backward is an operator."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, out: torch.Tensor, handle: torch.Tensor, context: int
    ) -> torch.Tensor:
        ctx.save_for_backward(handle)
        ctx.context = context
        return out.detach()  # as _TakePart's

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (handle,) = ctx.saved_tensors
        return take_part_backward_op(grad, handle, ctx.context), None, None


def _take_part(handle: torch.Tensor, context: int, register: bool, token: torch.Tensor) -> None:
    """Operator: a compiled fallback's forward part (registered here, or by the graph's exit)."""
    _forward(_module(handle, "fp8state::take_part"), "high-precision fallback", context, register)


def _take_part_fake(
    handle: torch.Tensor, context: int, register: bool, token: torch.Tensor
) -> None:
    return None


take_part_op = define(
    "take_part",
    "(Tensor handle, int context, bool register, Tensor(t!) token) -> ()",
    _take_part,
    _take_part_fake,
    TAGS,
)


def _take_part_backward(grad: torch.Tensor, handle: torch.Tensor, context: int) -> torch.Tensor:
    """Operator: a compiled fallback's backward part; returns a copy of ``grad``.

    A copy, because the backward graph keeps an operator only for what it returns: one that
    mutated a token of the backward's own would be dropped as dead code, and an operator may
    not return its argument itself.
    """
    module = _module(handle, "fp8state::take_part_backward")
    autocast.register_backward(module, context_of(context))
    return grad.clone()


def _take_part_backward_fake(
    grad: torch.Tensor, handle: torch.Tensor, context: int
) -> torch.Tensor:
    return torch.empty_like(grad)


take_part_backward_op = define(
    "take_part_backward",
    "(Tensor grad, Tensor handle, int context) -> Tensor",
    _take_part_backward,
    _take_part_backward_fake,
    TAGS,
)
