"""One GEMM of an FP8 module: ``y = x @ W.T + b`` with delayed-scaled FP8 operands.

Forward quantizes the input and the weight to the recipe's forward dtype (E4M3) with their
slots' current scales and records their amaxes; backward quantizes the incoming gradient to the
backward dtype (E5M2 under HYBRID) and records its amax. FP8 copies of input and weight are
what is saved for backward, a quarter of a float32 activation's memory.
"""

from __future__ import annotations

from typing import Any

import einops
import torch
import torch.nn.functional as F

from fp8state import autocast
from fp8state.backends import fp8_gemm, resolve_backend
from fp8state.mixin import FP8StateMixin
from fp8state.quantize import quantize, tensor_amax
from fp8state.slots import BwdSlot, FwdSlot, bwd_slot, fwd_slot

__all__ = ["linear"]


def linear(
    module: FP8StateMixin,
    inp: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gemm: int,
) -> torch.Tensor:
    """``F.linear(inp, weight, bias)``, in FP8 inside ``fp8_autocast(enabled=True)``.

    Args:
        module: The FP8 module owning the metadata.
        inp: ``(..., in_features)``.
        weight: ``(out_features, in_features)``.
        bias: ``(out_features,)`` or None.
        gemm: Index of this GEMM in the module (selects its slots).
    """
    ctx = autocast.active_context()
    if ctx is None:
        return F.linear(inp, weight, bias)
    autocast.register_forward(module, ctx)
    if not ctx.enabled:  # calibrating: record, compute in high precision
        module.fp8_record_amax("fwd", fwd_slot(gemm, FwdSlot.INPUT), tensor_amax(inp))
        module.fp8_record_amax("fwd", fwd_slot(gemm, FwdSlot.WEIGHT), tensor_amax(weight))
        return F.linear(inp, weight, bias)
    inp_2d, packed_shape = einops.pack([inp], "* k")
    out_2d = _FP8Linear.apply(inp_2d, weight, bias, module, gemm, ctx)
    [out] = einops.unpack(out_2d, packed_shape, "* n")
    return out


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        inp_2d: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        module: FP8StateMixin,
        gemm: int,
        fp8_ctx: autocast.FP8Context,
    ) -> torch.Tensor:
        fp8_dtype = fp8_ctx.recipe.fp8_format.dtype("fwd")
        meta = module.fp8_meta("fwd")
        slot_in = fwd_slot(gemm, FwdSlot.INPUT)
        slot_w = fwd_slot(gemm, FwdSlot.WEIGHT)
        module.fp8_record_amax("fwd", slot_in, tensor_amax(inp_2d))
        module.fp8_record_amax("fwd", slot_w, tensor_amax(weight))
        inp_fp8 = quantize(inp_2d, meta.scale[slot_in], fp8_dtype)
        weight_fp8 = quantize(weight, meta.scale[slot_w], fp8_dtype)
        # Copies: the live scale_inv changes when the step ends, before backward runs.
        inp_scale_inv = meta.scale_inv[slot_in].clone()
        weight_scale_inv = meta.scale_inv[slot_w].clone()
        backend = resolve_backend(fp8_ctx.gemm_backend, inp_2d.device)
        out, used = fp8_gemm(
            inp_fp8, inp_scale_inv, weight_fp8.t(), weight_scale_inv, inp_2d.dtype, backend
        )
        if bias is not None:
            out = out + bias
        module.fp8_last_gemm_backend = used
        ctx.save_for_backward(inp_fp8, weight_fp8, inp_scale_inv, weight_scale_inv)
        ctx.module, ctx.gemm, ctx.fp8_ctx, ctx.backend = module, gemm, fp8_ctx, backend
        ctx.inp_dtype, ctx.weight_dtype = inp_2d.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inp_fp8, weight_fp8, inp_scale_inv, weight_scale_inv = ctx.saved_tensors
        module: FP8StateMixin = ctx.module
        fp8_ctx: autocast.FP8Context = ctx.fp8_ctx
        slot_go = bwd_slot(ctx.gemm, BwdSlot.GRAD_OUTPUT)
        autocast.register_backward(module, fp8_ctx)
        module.fp8_record_amax("bwd", slot_go, tensor_amax(grad_out))
        meta = module.fp8_meta("bwd")
        grad_fp8 = quantize(grad_out, meta.scale[slot_go], fp8_ctx.recipe.fp8_format.dtype("bwd"))
        grad_scale_inv = meta.scale_inv[slot_go].clone()
        grad_inp = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # dgrad: (M, N) @ (N, K)
            grad_inp, _ = fp8_gemm(
                grad_fp8, grad_scale_inv, weight_fp8, weight_scale_inv, ctx.inp_dtype,
                ctx.backend,
            )
        if ctx.needs_input_grad[1]:  # wgrad: (N, M) @ (M, K)
            grad_weight, _ = fp8_gemm(
                grad_fp8.t(), grad_scale_inv, inp_fp8, inp_scale_inv, ctx.weight_dtype,
                ctx.backend,
            )
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_out.sum(dim=0).to(ctx.bias_dtype)
        return grad_inp, grad_weight, grad_bias, None, None, None
