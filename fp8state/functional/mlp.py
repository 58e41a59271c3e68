"""LayerNormMLP's ``fc2(gelu(fc1(x)))`` as one FP8 autograd function, GELU fused into the casts.

Run as three autograd nodes (fc1, GELU, fc2), the block writes and reads GELU's output in high
precision in forward, and GELU's input gradient in backward, only to cast each to FP8 right
after. Here the cast kernel computes GELU (forward) and ``grad * gelu'(h)`` (backward) in the
same pass that quantizes, records the amax and sums the bias gradient: two passes
over ``tokens x ffn`` elements less each way, and neither high-precision tensor is ever
allocated. What backward keeps: the FP8 transposes the gradients multiply with, and fc1's
output ``h`` (GELU's derivative needs it, as in TE), each dropped as soon as it is used; with
a norm computed by fc1's input cast, also the norm's input and the rows' statistics.
Neither GELU cast writes a transposed copy: the FP8 transposes come from a one-byte transpose
afterwards, faster for GELU's output, and for its gradient made only after ``h`` is dropped,
which keeps the peak below bf16's (docs/benchmarks.md).

Slots and amaxes are those of the per-GEMM path (fc1 = GEMM 0, fc2 = GEMM 1). The one
difference in numbers: GELU's output is quantized from float32 instead of from its rounding to
the input's dtype (identical for float32 inputs on the emulated path,
tests/modules/test_fused_mlp.py; the CUDA kernel's GELU is within about 1e-6 relative of
torch's, tests/gpu/test_cast_slot.py).
Intermediates are released as backward uses them, so one backward runs per forward (a second
one through the same graph is a clear error), as in TE. A recomputation (activation
checkpointing) replays its forward's decision and scales, as the per-GEMM path does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from fp8state import autocast
from fp8state._runtime import norm_cast, recompute
from fp8state._runtime.forward_record import MLP_SITE, ForwardRecord
from fp8state._runtime.friend import set_plain_attr
from fp8state._runtime.slot_cast import transpose_fp8
from fp8state.backends import fp8_gemm
from fp8state.errors import ConfigError
from fp8state.functional._slot import input_cast_for
from fp8state.functional.linear import (
    _cast_slot,
    _cast_weight,
    as_2d,
    fp8_backend,
    like_input,
)
from fp8state.functional.norm import InputNorm, from_args, fused_or_applied, norm_args
from fp8state.mixin import FP8StateMixin
from fp8state.slots import BwdSlot, FwdSlot, bwd_slot, fwd_slot

__all__ = ["gelu_mlp"]


def gelu_mlp(
    module: FP8StateMixin,
    inp: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    is_first_microbatch: bool | None,
    norm: InputNorm | None = None,
) -> torch.Tensor | None:
    """``fc2(gelu_tanh(fc1(inp)))`` fused in FP8, or None where the fused path does not apply.

    ``norm``: a LayerNorm or RMSNorm applied to ``inp`` first, computed by fc1's input cast (as
    :func:`fp8state.functional.linear.linear` does); where None is returned, the caller
    applies it.

    None (the caller then runs the GEMMs one by one) outside ``fp8_autocast(enabled=True)``,
    while calibrating, and where either GEMM is below the module's FP8 threshold
    (``fp8_min_gemm_macs``), so that fallback stays per GEMM and inspectable.
    """
    if torch.compiler.is_compiling():
        return None  # compiled as two GEMMs (fp8state.functional._compiled)
    weights = (fc1_weight, fc1_bias, fc2_weight, fc2_bias)
    if recompute.replaying():  # a recomputation: the forward's decision and scales
        replay = recompute.take(module, MLP_SITE)
        autocast.hold_backward_update()
        if replay.backend is None:
            return None
        x, norm = fused_or_applied(inp, norm)
        out = _FP8GeluMLP.apply(
            as_2d(x), *weights, *norm_args(norm), module, replay.ctx, replay.backend, None, None,
            replay,
        )  # fmt: skip
        return like_input(out, inp)
    ctx = autocast.active_context()
    backend = None
    if ctx is not None and ctx.enabled:
        tokens = inp.numel() // inp.shape[-1]
        smallest = tokens * min(
            fc1_weight.shape[0] * fc1_weight.shape[1], fc2_weight.shape[0] * fc2_weight.shape[1]
        )
        backend = fp8_backend(module, ctx, inp, smallest)
    # Kept even where the per-GEMM path runs instead: a recomputation must take it too.
    record = recompute.start(module, MLP_SITE, ctx, backend)
    if backend is None:
        if record is not None:
            recompute.finish(module, MLP_SITE, record, inp)
        return None
    assert ctx is not None
    autocast.register_forward(module, ctx)
    x, norm = fused_or_applied(inp, norm)
    out = _FP8GeluMLP.apply(
        as_2d(x), *weights, *norm_args(norm), module, ctx, backend, is_first_microbatch, record,
        None,
    )  # fmt: skip
    if record is not None:
        recompute.finish(module, MLP_SITE, record, out)
    return like_input(out, inp)


class _FP8GeluMLP(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        inp: torch.Tensor,
        fc1_weight: torch.Tensor,
        fc1_bias: torch.Tensor | None,
        fc2_weight: torch.Tensor,
        fc2_bias: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        norm_bias: torch.Tensor | None,
        norm_eps: float | None,
        norm_rms: bool,
        module: FP8StateMixin,
        fp8_ctx: autocast.FP8Context,
        backend: str,
        is_first_microbatch: bool | None,
        record: ForwardRecord | None,
        replay: ForwardRecord | None,
    ) -> torch.Tensor:
        dtype = fp8_ctx.recipe.fp8_format.dtype("fwd")
        needs = ctx.needs_input_grad
        need_w1, need_w2 = needs[1], needs[3]
        need_x = needs[0] or needs[5] or needs[6]  # the input's gradient, or the norm's
        # GELU's input gradient is needed for everything upstream of fc2's output.
        need_chain = need_x or needs[1] or needs[2]
        norm = from_args(norm_weight, norm_bias, norm_eps, norm_rms)
        x_fp8, x_fp8_t, x_inv, stats = input_cast_for(
            module, fwd_slot(0, FwdSlot.INPUT), inp, dtype, need_w1, replay, norm
        )
        # With a norm, what its backward takes: its input and the rows' statistics (its
        # parameters are the module's: nothing to release).
        norm_saved = [inp, *stats] if norm is not None else []
        ctx.norm = norm
        w1_fp8, w1_fp8_t, w1_inv = _cast_weight(
            module, fc1_weight, 0, dtype, need_x, is_first_microbatch, record, replay
        )
        h, _ = fp8_gemm(
            x_fp8, x_inv, w1_fp8.t(), w1_inv, inp.dtype, backend, bias=fc1_bias, fast_accum=True
        )
        del x_fp8
        # No transposed copy from this cast either: with GELU's arithmetic in the same pass,
        # transposed stores slow it down more than a one-byte transpose afterwards costs
        # (docs/benchmarks.md).
        a_fp8, _, a_inv, _ = _cast_slot(
            module, "fwd", fwd_slot(1, FwdSlot.INPUT), h, dtype, False, op="gelu", replay=replay
        )
        a_fp8_t = transpose_fp8(a_fp8) if need_w2 else None
        w2_fp8, w2_fp8_t, w2_inv = _cast_weight(
            module, fc2_weight, 1, dtype, need_chain, is_first_microbatch, record, replay
        )
        out, used = fp8_gemm(
            a_fp8, a_inv, w2_fp8.t(), w2_inv, inp.dtype, backend, bias=fc2_bias, fast_accum=True
        )
        set_plain_attr(module, "fp8_last_gemm_backend", used)
        tensors = [
            x_fp8_t,
            w1_fp8_t,
            h if need_chain else None,
            a_fp8_t,
            w2_fp8_t,
            x_inv,
            w1_inv,
            a_inv,
            w2_inv,
            *norm_saved,  # with a norm, what its backward takes
        ]
        ctx.from_hooks = recompute.hooks_active()
        if ctx.from_hooks:
            # Offloading or recomputation hooks (save_on_cpu, checkpointing) must see them.
            ctx.save_for_backward(*tensors)
            ctx.tensors = None
        else:
            # Kept on ctx: they are this function's own intermediates (no version checks
            # needed), and backward drops each the moment it is used, as the per-GEMM path's
            # separate autograd nodes free theirs; saved tensors would stay alive until
            # backward returns (h alone is tokens x ffn in high precision).
            ctx.tensors = tensors
        ctx.module, ctx.fp8_ctx, ctx.backend, ctx.need_chain = module, fp8_ctx, backend, need_chain
        ctx.dtypes = (
            inp.dtype,
            fc1_weight.dtype,
            fc2_weight.dtype,
            None if fc1_bias is None else fc1_bias.dtype,
            None if fc2_bias is None else fc2_bias.dtype,
        )
        return out

    @staticmethod
    @once_differentiable  # FP8 casts have no useful derivative: a clear error for 2nd order
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.from_hooks:
            ctx.tensors = list(ctx.saved_tensors)
        if ctx.tensors is None:
            raise ConfigError(
                f"{type(ctx.module).__name__} (fused GELU path)",
                "a second backward pass through the same graph (retain_graph=True)",
                "one backward per forward",
                "Set module.fp8_fuse_activation = False for graphs you backpropagate through "
                "more than once.",
            )
        x_fp8_t, w1_fp8_t, h, a_fp8_t, w2_fp8_t, x_inv, w1_inv, a_inv, w2_inv, *norm_saved = (
            ctx.tensors
        )
        ctx.tensors = None  # from here on, the locals below are the only references
        module, fp8_ctx, backend = ctx.module, ctx.fp8_ctx, ctx.backend
        inp_dtype, w1_dtype, w2_dtype, b1_dtype, b2_dtype = ctx.dtypes
        needs = ctx.needs_input_grad
        bwd_dtype = fp8_ctx.recipe.fp8_format.dtype("bwd")
        autocast.register_backward(module, fp8_ctx)
        need_b2 = b2_dtype is not None and needs[4]
        g_fp8, g_fp8_t, g_inv, g_sums = _cast_slot(
            module,
            "bwd",
            bwd_slot(1, BwdSlot.GRAD_OUTPUT),
            grad_out,
            bwd_dtype,
            needs[3],
            column_sums=need_b2,
        )
        grads: list[torch.Tensor | None] = [None] * 15
        need_x = needs[0] or needs[5] or needs[6]  # the input's gradient, or the norm's
        if needs[3]:  # fc2 weight: (hidden, M) @ (M, ffn)
            assert g_fp8_t is not None  # cast with transpose=needs[3]
            grads[3], _ = fp8_gemm(g_fp8_t, g_inv, a_fp8_t.t(), a_inv, w2_dtype, backend)
        del a_fp8_t, g_fp8_t
        if need_b2:
            assert g_sums is not None  # cast with column_sums=need_b2
            grads[4] = g_sums.to(b2_dtype)
        if not ctx.need_chain:
            return tuple(grads)
        d_act, _ = fp8_gemm(g_fp8, g_inv, w2_fp8_t.t(), w2_inv, inp_dtype, backend)
        del g_fp8, w2_fp8_t
        need_b1 = b1_dtype is not None and needs[2]
        # No transposed copy from this cast: its two FP8 outputs (tokens x ffn each) beside h
        # and fc2's input gradient would set the block's peak memory. The transpose is made
        # from the FP8 copy once those two are freed (one more pass over one byte per element).
        dh_fp8, _, dh_inv, dh_sums = _cast_slot(
            module,
            "bwd",
            bwd_slot(0, BwdSlot.GRAD_OUTPUT),
            d_act,
            bwd_dtype,
            False,
            column_sums=need_b1,
            op="dgelu",
            aux=h,
        )
        del d_act, h
        if need_x:  # input: (M, ffn) @ (ffn, hidden)
            d_inp, _ = fp8_gemm(dh_fp8, dh_inv, w1_fp8_t.t(), w1_inv, inp_dtype, backend)
            grads[0] = d_inp
            if norm_saved:  # that was the norm's output gradient
                x, *stats = norm_saved
                norm: InputNorm = ctx.norm
                grads[0], grads[5], grads[6] = norm_cast.norm_backward(
                    d_inp, x, norm.weight, norm.bias, norm.eps, tuple(stats),
                    (needs[0], needs[5], needs[6]), rms=norm.rms,
                )  # fmt: skip
                del x, stats
            del norm_saved, d_inp
        if needs[1]:  # fc1 weight: (ffn, M) @ (M, hidden)
            dh_fp8_t = transpose_fp8(dh_fp8)
            del dh_fp8
            grads[1], _ = fp8_gemm(dh_fp8_t, dh_inv, x_fp8_t.t(), x_inv, w1_dtype, backend)
        if need_b1:
            assert dh_sums is not None  # cast with column_sums=need_b1
            grads[2] = dh_sums.to(b1_dtype)
        return tuple(grads)
