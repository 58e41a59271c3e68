"""An FP8 GEMM as ``torch.compile`` traces it: no graph break, no guard on the module's state.

:func:`linear` is what :func:`fp8state.functional.linear.linear` runs while Dynamo traces. The
decisions (FP8 or high precision, the backend, the dtypes) come from the ``fp8_autocast`` in
force and the shapes, which Dynamo guards on as usual; everything that changes from step to
step stays out of the trace, in the custom operators of :mod:`._ops`. So a compiled step runs
the numbers of an eager one: the same casts with the same scales, the same amax records and
scale updates (at the ``fp8_autocast`` exit, and at the end of backward).

FP8 weights cached across micro-batches (``is_first_microbatch``) are the eager path's cache,
through an operator that hands the graph copies (:func:`._ops.weight_op`); Dynamo compiles
one graph per value of the argument. What a compiled call does not do: replay a recomputation
(a checkpoint around the compiled call raises; one inside it is a graph break, and runs
eagerly); the fused GELU MLP runs as its two GEMMs. docs/compile.md has the whole list.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fp8state import autocast
from fp8state._runtime import context_stack, handles
from fp8state._runtime.context_stack import TOKEN
from fp8state.backends import gemm_runs_as, min_gemm_macs, resolve_backend
from fp8state.errors import ConfigError
from fp8state.functional import _take_part
from fp8state.functional._ops import cast_op, gemm_op, record_op, refuse, weight_op
from fp8state.functional._shapes import as_2d, like_input
from fp8state.mixin import FP8StateMixin
from fp8state.slots import BwdSlot, FwdSlot, bwd_slot, fwd_slot

__all__ = ["linear"]


def linear(
    module: FP8StateMixin,
    inp: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gemm: int,
    is_first_microbatch: bool | None,
) -> torch.Tensor:
    """:func:`fp8state.functional.linear.linear` for a graph being compiled."""
    ctx = autocast.active_context()
    if ctx is None:
        return F.linear(inp, weight, bias)
    handle = handles.handle_of(module)  # a graph input: modules alike share one graph
    context = context_stack.context_handle(ctx)
    inp_2d = as_2d(inp)
    if not ctx.enabled:  # calibrating: record, compute in high precision
        register = context_stack.note_call(handle, context)
        for x, role in ((inp_2d, FwdSlot.INPUT), (weight, FwdSlot.WEIGHT)):
            record_op(x, handle, context, register, fwd_slot(gemm, role), TOKEN)
        return F.linear(inp, weight, bias)
    backend, error = _resolved(ctx.gemm_backend, inp.device)
    if error:  # raised when the graph runs
        refuse(*error)
    if inp.numel() * weight.shape[0] < min_gemm_macs(
        backend, module.fp8_min_gemm_macs, module.fp8_graphed
    ):
        _note_backend(module, "high_precision")
        out = F.linear(inp, weight, bias)
        if _take_part.takes_part(module, ctx):  # other ranks may run it in FP8
            out = _take_part.compiled(handle, context, out)
        return out
    _note_backend(module, gemm_runs_as(backend, inp_2d.shape[1], weight.shape[0]))
    register = context_stack.note_call(handle, context)
    fp8_format = ctx.recipe.fp8_format
    dtypes = (fp8_format.dtype("fwd"), fp8_format.dtype("bwd"))
    how = (context, register, gemm, *dtypes, backend, is_first_microbatch)
    out = _CompiledFP8Linear.apply(inp_2d, weight, bias, handle, how)
    return like_input(out, inp)


def _note_backend(module: FP8StateMixin, backend: str) -> None:
    # An attribute store while Dynamo traces: the graph leaves it out and Dynamo replays it
    # after each run, in program order with the graph's other stores (the backend is known
    # when tracing). An operator here cost every fallback GEMM of a compiled step a dispatch
    # from the host and split Inductor's CUDA graphs around it (docs/benchmarks.md).
    module.fp8_last_gemm_backend = backend


@torch.compiler.assume_constant_result
def _resolved(requested: str, device: torch.device) -> tuple[str, tuple[str, ...]]:
    # Run as it is, not traced: its cache's contents would become guards (a recompilation
    # once it fills). The answer depends on the device alone, which the graph guards on.
    # A refusal comes back as the error's fields, raised by the graph when it runs.
    try:
        return resolve_backend(requested, device), ()
    except ConfigError as err:
        return "emulated", (err.key, err.found, err.expected, err.fix)


class _CompiledFP8Linear(torch.autograd.Function):
    """``_FP8Linear``'s arithmetic, with every cast one operator call.

    :func:`._ops.cast_op`, or :func:`._ops.weight_op` for a weight given ``is_first_microbatch``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        inp: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        handle: torch.Tensor,
        how: tuple[int, bool, int, torch.dtype, torch.dtype, str, bool | None],
    ) -> torch.Tensor:
        context, register, gemm, fwd_dtype, _, backend, first = how
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        meta = (handle, context, register, "fwd")
        inp_fp8, inp_fp8_t, inp_inv, _ = cast_op(
            inp.contiguous(), *meta, fwd_slot(gemm, FwdSlot.INPUT), fwd_dtype, need_wgrad,
            False, "identity", None, TOKEN,
        )  # fmt: skip
        weight = weight.detach().contiguous()
        if first is None:  # cast every call
            weight_fp8, weight_fp8_t, weight_inv, _ = cast_op(
                weight, *meta, fwd_slot(gemm, FwdSlot.WEIGHT), fwd_dtype, need_dgrad, False,
                "identity", None, TOKEN,
            )  # fmt: skip
        else:  # through the module's cache of FP8 weights, as eagerly
            weight_fp8, weight_fp8_t, weight_inv = weight_op(
                weight, handle, context, register, gemm, fwd_dtype, need_dgrad, first, TOKEN
            )
        # Fast accumulation in forward only, as the eager path (fp8state.backends.fp8_gemm).
        out = gemm_op(inp_fp8, inp_inv, weight_fp8.t(), weight_inv, inp.dtype, backend, bias, True)
        ctx.save_for_backward(inp_fp8_t, weight_fp8_t, inp_inv, weight_inv, handle)
        ctx.how = how
        ctx.dtypes = (inp.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inp_fp8_t, weight_fp8_t, inp_inv, weight_inv, handle = ctx.saved_tensors
        context, _, gemm, _, bwd_dtype, backend, _ = ctx.how
        inp_dtype, weight_dtype, bias_dtype = ctx.dtypes
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
        need_bias = bias_dtype is not None and need_bgrad
        # A token of the backward's own: the forward's global one, saved for backward, would
        # be modified by every later compiled forward before this backward runs.
        token = grad_out.new_empty(0)
        grad_fp8, grad_fp8_t, grad_inv, grad_sums = cast_op(
            grad_out.contiguous(), handle, context, False, "bwd",
            bwd_slot(gemm, BwdSlot.GRAD_OUTPUT), bwd_dtype, need_wgrad, need_bias, "identity",
            None, token,
        )  # fmt: skip
        grad_inp = grad_weight = grad_bias = None
        if need_dgrad:  # (M, N) @ (N, K)
            grad_inp = gemm_op(
                grad_fp8, grad_inv, weight_fp8_t.t(), weight_inv, inp_dtype, backend, None, False
            )
        if need_wgrad:  # (N, M) @ (M, K)
            grad_weight = gemm_op(
                grad_fp8_t, grad_inv, inp_fp8_t.t(), inp_inv, weight_dtype, backend, None, False
            )
        if need_bias:
            grad_bias = grad_sums.to(bias_dtype)
        return grad_inp, grad_weight, grad_bias, None, None
