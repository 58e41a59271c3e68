"""A norm (LayerNorm or RMSNorm) computed within its output's FP8 cast, and its backward.

On CUDA (where :func:`fp8state._runtime.slot_cast.fused_kernel_available` holds and rows
fit in registers) one kernel normalizes, rounds to the input's dtype and casts
(:mod:`fp8state._kernels.norm_launch`), and another computes the backward. Elsewhere the
norm as torch computes it (``torch.native_layer_norm``, ``F.rms_norm``) and
:func:`fp8state._runtime.slot_cast.cast_slot` compute the same thing in two steps, and
torch's own backward of the norm the backward: the norm's output as ``F.layer_norm`` or
``F.rms_norm`` returns it, cast as any operand is, and the gradients autograd would give.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fp8state._runtime.slot_cast import cast_slot, fused_kernel_available, transpose_fp8

__all__ = ["fusable", "norm_backward", "norm_cast_slot"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fusable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the cast can compute the norm of ``x`` itself and give torch's output.

    The norm's parameters must share ``x``'s dtype (the output's then), and no
    ``torch.autocast`` may be on: it runs the norms in float32.
    """
    return (
        x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and not torch.is_autocast_enabled(x.device.type)
    )


def _kernel(x_2d: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether the CUDA kernels take ``x_2d`` and the tensors that go with it."""
    if not fused_kernel_available(x_2d):  # no Triton, no CUDA, or another conversion
        return False
    from fp8state._kernels.norm_launch import MAX_COLUMNS

    return x_2d.shape[1] <= MAX_COLUMNS and all(
        t is None or (t.is_contiguous() and t.device == x_2d.device) for t in others
    )


def norm_cast_slot(
    x_2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    history: torch.Tensor,
    slot: int,
    fp8_dtype: torch.dtype,
    *,
    transpose: bool,
    new_step: bool,
    rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`fp8state._runtime.slot_cast.cast_slot` of ``F.layer_norm(x_2d)`` (or ``rms_norm``).

    Args:
        x_2d: ``(M, N)`` contiguous input of the norm (:func:`fusable` holds).
        weight: The norm's ``(N,)`` weight.
        bias: The norm's ``(N,)`` bias, or None (always None with ``rms``).
        eps: The norm's epsilon.
        scale: The direction's ``(n,)`` float32 scales.
        scale_inv: The direction's ``(n,)`` float32 inverse scales.
        history: The direction's ``(rows, n)`` float32 amax history.
        slot: The operand's slot.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        transpose: Also return the contiguous transpose.
        new_step: First record of the direction since its last scale update.
        rms: The norm is ``F.rms_norm`` (without a bias), not ``F.layer_norm``.

    Returns:
        ``(x_fp8, x_fp8_t or None, scale_inv_snapshot, stats)``: ``stats`` is what
        :func:`norm_backward` takes besides the norm's input and parameters (the rows' float32
        ``(M, 1)`` mean and reciprocal standard deviation; RMSNorm's kernel keeps only the
        latter and its reference nothing, as its backward recomputes the norm).
    """
    if _kernel(x_2d, weight, bias, scale, scale_inv, history):
        from fp8state._kernels.norm_launch import norm_cast_slot as launch

        out, inv, mean, rstd = launch(
            x_2d, weight, bias, eps, scale, scale_inv, history, slot, fp8_dtype, new_step, rms
        )
        # The transposed copy from the FP8 rows: a row program holds too few rows to store
        # long runs of each column (docs/benchmarks.md).
        kept = (rstd,) if mean is None else (mean, rstd)
        return out, (transpose_fp8(out) if transpose else None), inv, kept
    stats: tuple[torch.Tensor, ...] = ()
    if rms:
        normed = F.rms_norm(x_2d, weight.shape, weight, eps)
    else:
        normed, *moments = torch.native_layer_norm(x_2d, weight.shape, weight, bias, eps)
        stats = tuple(moments)
    x_fp8, x_fp8_t, inv, _ = cast_slot(
        normed, scale, scale_inv, history, slot, fp8_dtype, transpose=transpose, new_step=new_step
    )
    return x_fp8, x_fp8_t, inv, stats


def norm_backward(
    grad: torch.Tensor,
    x_2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    stats: tuple[torch.Tensor, ...],
    needs: tuple[bool, bool, bool],
    *,
    rms: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of the norm's input, weight and bias (None where ``needs`` says so).

    ``grad`` is the gradient of the norm's output, ``stats`` are :func:`norm_cast_slot`'s.
    """
    if stats and _kernel(x_2d, grad, weight, *stats) and grad.dtype == x_2d.dtype:
        from fp8state._kernels.norm_launch import norm_backward as launch

        mean = None if rms else stats[0]
        dx, dw, db = launch(grad, x_2d, weight, bias, mean, stats[-1], needs[1] or needs[2])
        return (dx if needs[0] else None), (dw if needs[1] else None), (db if needs[2] else None)
    if rms:  # torch's backward of the norm it computed (the reference keeps no stats)
        return (*_autograd_rms_backward(grad, x_2d, weight, eps, (needs[0], needs[1])), None)
    mean, rstd = stats
    grads = torch.ops.aten.native_layer_norm_backward(
        grad, x_2d, [x_2d.shape[1]], mean, rstd, weight, bias, list(needs)
    )
    return grads[0], grads[1], (grads[2] if bias is not None else None)


def _autograd_rms_backward(
    grad: torch.Tensor,
    x_2d: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    needs: tuple[bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What autograd gives ``x_2d`` and ``weight`` through ``F.rms_norm`` (``needs`` each)."""
    x = x_2d.detach().requires_grad_(needs[0])
    w = weight.detach().requires_grad_(needs[1])
    wanted = [t for t in (x, w) if t.requires_grad]
    with torch.enable_grad():
        out = F.rms_norm(x, weight.shape, w, eps)
        found = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
    return (next(found) if needs[0] else None), (next(found) if needs[1] else None)
