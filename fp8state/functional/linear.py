"""One GEMM of an FP8 module: ``y = x @ W.T + b`` with delayed-scaled FP8 operands.

Forward casts the input and the weight to the recipe's forward dtype (E4M3) with their slots'
current scales, recording their amaxes; backward casts the incoming gradient to the backward
dtype (E5M2 under HYBRID). FP8 GEMMs take the second operand column-major, so each cast also
writes the transposed copy its operand needs in backward, in the same pass
(:func:`fp8state._runtime.slot_cast.cast_and_record`); only those FP8 transposes are saved for
backward (and, where the input's cast computes a norm, what the norm's backward takes).

Weights can be cast once per optimizer step and reused across micro-batches
(``is_first_microbatch``, as in TE), and GEMMs too small for FP8 to pay run in high precision
(``FP8StateMixin.fp8_min_gemm_macs``).

A call recomputed by activation checkpointing replays its forward: the same decision, backend,
scales and cached weight, without recording anything (:mod:`fp8state._runtime.recompute`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fp8state import autocast
from fp8state._runtime import gemm_sizes, microbatch, norm_cast, recompute
from fp8state._runtime.forward_record import ForwardRecord
from fp8state._runtime.friend import set_plain_attr
from fp8state._runtime.slot_cast import transpose_fp8
from fp8state.backends import fp8_gemm, min_gemm_macs, resolve_backend
from fp8state.functional import _compiled, _take_part
from fp8state.functional._shapes import as_2d, like_input
from fp8state.functional._slot import cast_for as _cast_slot
from fp8state.functional._slot import input_cast_for, weight_for
from fp8state.functional.norm import InputNorm, applied, from_args, fused_or_applied, norm_args
from fp8state.mixin import FP8StateMixin
from fp8state.quantize import finite_amax
from fp8state.slots import BwdSlot, FwdSlot, bwd_slot, fwd_slot

__all__ = [
    "linear",
    "fp8_backend",
    "runs_in_fp8",
    "cast_weight_ahead",
    "as_2d",
    "like_input",
]


def linear(
    module: FP8StateMixin,
    inp: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gemm: int,
    is_first_microbatch: bool | None = None,
    norm: InputNorm | None = None,
) -> torch.Tensor:
    """``F.linear(inp, weight, bias)``, in FP8 inside ``fp8_autocast(enabled=True)``.

    Args:
        module: The FP8 module owning the metadata.
        inp: ``(..., in_features)``.
        weight: ``(out_features, in_features)``.
        bias: ``(out_features,)`` or None.
        gemm: Index of this GEMM in the module (selects its slots).
        is_first_microbatch: None casts the weight every call. True casts it, records its
            amax and keeps the FP8 copy; False reuses that copy (later micro-batches of the same
            optimizer step, where the weight has not changed).
        norm: A LayerNorm or RMSNorm to apply to ``inp`` first (``F.linear(norm(inp), ...)``).
            In FP8 its output is never written in high precision: the input's cast computes it
            (:func:`fp8state._runtime.norm_cast.norm_cast_slot`), and backward runs the
            norm's backward after the input-gradient GEMM.
    """
    if torch.compiler.is_compiling():  # no graph break, no guard on Python state
        inp = applied(inp, norm)  # Inductor fuses the norm itself
        return _compiled.linear(module, inp, weight, bias, gemm, is_first_microbatch)
    if recompute.replaying():
        return _replay(module, inp, weight, bias, gemm, norm)
    ctx = autocast.active_context()
    if ctx is None:
        return _high_precision(module, gemm, None, applied(inp, norm), weight, bias)
    if not ctx.enabled:  # calibrating: record, compute in high precision
        inp = applied(inp, norm)
        autocast.register_forward(module, ctx)
        module.fp8_record_amax("fwd", fwd_slot(gemm, FwdSlot.INPUT), finite_amax(inp))
        module.fp8_record_amax("fwd", fwd_slot(gemm, FwdSlot.WEIGHT), finite_amax(weight))
        return _high_precision(module, gemm, ctx, inp, weight, bias)
    backend = fp8_backend(module, ctx, inp, inp.numel() * weight.shape[0])  # tokens*in*out
    if backend is None:
        set_plain_attr(module, "fp8_last_gemm_backend", "high_precision")
        out = _high_precision(module, gemm, ctx, applied(inp, norm), weight, bias)
        if _take_part.takes_part(module, ctx):  # other ranks may run it in FP8
            out = _take_part.forward(module, ctx, out)
        return out
    autocast.register_forward(module, ctx)
    record = recompute.start(module, gemm, ctx, backend)
    x, norm = fused_or_applied(inp, norm)
    out = _FP8Linear.apply(
        as_2d(x), weight, bias, *norm_args(norm), module, gemm, ctx, backend,
        is_first_microbatch, record, None,
    )  # fmt: skip
    if record is not None:
        recompute.finish(module, gemm, record, out)
    return like_input(out, inp)


def _high_precision(
    module: FP8StateMixin,
    gemm: int,
    ctx: autocast.FP8Context | None,
    inp: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``F.linear``, noting the decision where a recomputation may have to replay it."""
    record = recompute.start(module, gemm, ctx, None)
    out = F.linear(inp, weight, bias)
    if record is not None:
        recompute.finish(module, gemm, record, out)
    return out


def _replay(
    module: FP8StateMixin,
    inp: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gemm: int,
    norm: InputNorm | None,
) -> torch.Tensor:
    """A recomputation of this call: what its forward computed, recording nothing."""
    record = recompute.take(module, gemm)
    autocast.hold_backward_update()
    ctx = record.ctx
    if record.backend is None:
        out = F.linear(applied(inp, norm), weight, bias)
        fp8_ctx = cast(autocast.FP8Context | None, ctx)
        if fp8_ctx is not None and fp8_ctx.enabled:
            set_plain_attr(module, "fp8_last_gemm_backend", "high_precision")
            if _take_part.takes_part(module, fp8_ctx):
                out = _take_part.replayed(module, fp8_ctx, out)
        return out
    x, norm = fused_or_applied(inp, norm)
    out = _FP8Linear.apply(
        as_2d(x), weight, bias, *norm_args(norm), module, gemm, ctx, record.backend, None, None,
        record,
    )  # fmt: skip
    return like_input(out, inp)


def fp8_backend(
    module: FP8StateMixin, ctx: autocast.FP8Context, inp: torch.Tensor, macs: int
) -> str | None:
    """The GEMM backend for FP8 compute, or None where ``macs`` is below the threshold."""
    if gemm_sizes.LISTENING:
        gemm_sizes.hear(macs)
    backend = resolve_backend(ctx.gemm_backend, inp.device)
    threshold = min_gemm_macs(backend, module.fp8_min_gemm_macs, module.fp8_graphed)
    return None if macs < threshold else backend


def runs_in_fp8(
    module: FP8StateMixin, ctx: autocast.FP8Context, weight: torch.Tensor, tokens: int
) -> bool:
    """Whether a call of ``tokens`` rows multiplies ``weight`` in FP8 under ``ctx``.

    Not where its multiply-accumulates fall below the module's threshold: such a call runs
    in high precision (:func:`fp8_backend`).
    """
    return fp8_backend(module, ctx, weight, tokens * weight.numel()) is not None


def cast_weight_ahead(
    module: FP8StateMixin, ctx: autocast.FP8Context, gemm: int, weight: torch.Tensor
) -> None:
    """Cast GEMM ``gemm``'s weight as a first micro-batch's FP8 call would, and keep it.

    The cast of ``weight_for(..., is_first_microbatch=True)``: the slot's scale, its amax
    recorded, the copy kept in ``module.fp8_weight_cache`` (with its transpose where gradients
    are enabled) for the calls that reuse it.
    """
    dtype = ctx.recipe.fp8_format.dtype("fwd")
    weight_for(module, gemm, weight.detach(), dtype, torch.is_grad_enabled(), True)


def _cast_weight(
    module: FP8StateMixin,
    weight: torch.Tensor,
    gemm: int,
    fp8_dtype: torch.dtype,
    transpose: bool,
    is_first_microbatch: bool | None,
    record: ForwardRecord | None = None,
    replay: ForwardRecord | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """FP8 weight, its transpose (if asked) and inverse scale, from the cache when allowed.

    ``record`` notes a cached weight the call reuses; ``replay`` reuses the one its forward
    did, or casts as the forward did, with the forward's scale and without the cache.
    """
    if replay is not None:
        used = replay.cached_weight(module, gemm)
        if used is None:
            slot = fwd_slot(gemm, FwdSlot.WEIGHT)
            weight_fp8, weight_fp8_t, scale_inv, _ = _cast_slot(
                module, "fwd", slot, weight.detach(), fp8_dtype, transpose, replay=replay
            )
            return weight_fp8, weight_fp8_t, scale_inv
        weight_fp8, weight_fp8_t, scale_inv = used
        if transpose and weight_fp8_t is None:  # a reentrant forward ran without gradients
            weight_fp8_t = transpose_fp8(weight_fp8)
        return weight_fp8, weight_fp8_t, scale_inv
    # A graph being captured for one kind of micro-batch decides for calls that do not.
    is_first_microbatch = microbatch.first_microbatch(is_first_microbatch)
    used, reused = weight_for(
        module, gemm, weight.detach(), fp8_dtype, transpose, is_first_microbatch
    )
    if record is not None and reused:
        record.reuse_weight(gemm, used, transpose)
    elif record is not None and is_first_microbatch is not None:
        record.cache_weight(gemm, used[0])
    return used


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        inp_2d: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        norm_bias: torch.Tensor | None,
        norm_eps: float | None,
        norm_rms: bool,
        module: FP8StateMixin,
        gemm: int,
        fp8_ctx: autocast.FP8Context,
        backend: str,
        is_first_microbatch: bool | None,
        record: ForwardRecord | None,
        replay: ForwardRecord | None,
    ) -> torch.Tensor:
        fp8_dtype = fp8_ctx.recipe.fp8_format.dtype("fwd")
        needs = ctx.needs_input_grad
        # The GEMM's input gradient feeds the norm's gradients too.
        need_dgrad, need_wgrad = needs[0] or needs[3] or needs[4], needs[1]
        norm = from_args(norm_weight, norm_bias, norm_eps, norm_rms)
        inp_fp8, inp_fp8_t, inp_scale_inv, stats = input_cast_for(
            module, fwd_slot(gemm, FwdSlot.INPUT), inp_2d, fp8_dtype, need_wgrad, replay, norm
        )
        # With a norm, what its backward takes: its input, parameters and the rows' stats.
        norm_saved = (inp_2d, norm_weight, norm_bias, *stats) if norm is not None else ()
        ctx.norm_spec = (norm_eps, norm_rms)
        weight_fp8, weight_fp8_t, weight_scale_inv = _cast_weight(
            module, weight, gemm, fp8_dtype, need_dgrad, is_first_microbatch, record, replay
        )
        out, used = fp8_gemm(
            inp_fp8,
            inp_scale_inv,
            weight_fp8.t(),
            weight_scale_inv,
            inp_2d.dtype,
            backend,
            bias=bias,
            fast_accum=True,  # forward only, as TE (see fp8_gemm)
        )
        set_plain_attr(module, "fp8_last_gemm_backend", used)
        # Only what backward multiplies with, in the layout it needs: FP8, not the input.
        ctx.save_for_backward(inp_fp8_t, weight_fp8_t, inp_scale_inv, weight_scale_inv, *norm_saved)
        ctx.module, ctx.gemm, ctx.fp8_ctx, ctx.backend = module, gemm, fp8_ctx, backend
        ctx.inp_dtype, ctx.weight_dtype = inp_2d.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    @once_differentiable  # FP8 casts have no useful derivative: a clear error for 2nd order
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inp_fp8_t, weight_fp8_t, inp_scale_inv, weight_scale_inv, *norm_saved = ctx.saved_tensors
        module: FP8StateMixin = ctx.module
        fp8_ctx: autocast.FP8Context = ctx.fp8_ctx
        needs = ctx.needs_input_grad
        need_dgrad, need_wgrad, need_bgrad = needs[0] or needs[3] or needs[4], needs[1], needs[2]
        autocast.register_backward(module, fp8_ctx)
        need_bias = ctx.bias_dtype is not None and need_bgrad
        grad_fp8, grad_fp8_t, grad_scale_inv, grad_sums = _cast_slot(
            module,
            "bwd",
            bwd_slot(ctx.gemm, BwdSlot.GRAD_OUTPUT),
            grad_out,
            fp8_ctx.recipe.fp8_format.dtype("bwd"),
            need_wgrad,
            column_sums=need_bias,
        )
        grad_inp = grad_weight = grad_bias = None
        if need_dgrad:  # (M, N) @ (N, K); weight_fp8_t.t() is (N, K) column-major
            grad_inp, _ = fp8_gemm(
                grad_fp8,
                grad_scale_inv,
                weight_fp8_t.t(),
                weight_scale_inv,
                ctx.inp_dtype,
                ctx.backend,
            )
        if need_wgrad:  # (N, M) @ (M, K); inp_fp8_t.t() is (M, K) column-major
            assert grad_fp8_t is not None  # cast with transpose=need_wgrad
            grad_weight, _ = fp8_gemm(
                grad_fp8_t,
                grad_scale_inv,
                inp_fp8_t.t(),
                inp_scale_inv,
                ctx.weight_dtype,
                ctx.backend,
            )
        if need_bias:
            assert grad_sums is not None  # cast with column_sums=need_bias
            grad_bias = grad_sums.to(ctx.bias_dtype)
        grad_norm_weight = grad_norm_bias = None
        if norm_saved and grad_inp is not None:  # the GEMM's input gradient is the norm's
            x, norm_weight, norm_bias, *stats = norm_saved
            eps, rms = ctx.norm_spec
            grad_inp, grad_norm_weight, grad_norm_bias = norm_cast.norm_backward(
                grad_inp, x, norm_weight, norm_bias, eps, tuple(stats),
                (needs[0], needs[3], needs[4]), rms=rms,
            )  # fmt: skip
        grads = (grad_inp, grad_weight, grad_bias, grad_norm_weight, grad_norm_bias)
        return (*grads, *[None] * 9)  # eps, rms, module, gemm, context, backend, ...
