"""Cast an operand to FP8 and record its amax, fused on CUDA, with pure functions elsewhere.

:func:`cast_and_record` is the one entry point the modules use. On CUDA (with Triton, on the
devices :func:`converts_in_one_rounding` accepts) it runs one kernel that reads the tensor once
and writes the FP8 copy, its transpose when backward needs one, and the amax straight into the
slot's history cell. Elsewhere it runs the pure functions of :mod:`fp8state.quantize`, which
define the result: the GPU tests compare the two bit for bit.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from fp8state.errors import ConfigError
from fp8state.quantize import CAST_OPS, apply_op, finite_amax, quantize
from fp8state.scaling import shift_history

__all__ = [
    "cast_and_record",
    "cast_slot",
    "converts_in_one_rounding",
    "fused_kernel_available",
    "kernels_available",
    "transpose_fp8",
]

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The kernel indexes in 32 bits; larger tensors take the (slower, exact) reference path.
_KERNEL_MAX_NUMEL = 2**31


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernel_layout(x: torch.Tensor) -> bool:
    """Whether ``x`` is a tensor fp8state's 2-D Triton kernels take (any dtype)."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.is_contiguous()
        and 0 < x.numel() < _KERNEL_MAX_NUMEL
        and _triton_installed()
    )


# Triton converts float32 to FP8 with one rounding (``cvt.rn.satfinite``: to nearest, finite
# values and infinities past the maximum saturated, NaN kept) on NVIDIA GPUs from compute
# capability 9.0. Below 8.9 it has no E4M3 type (compiling the cast raises); on 8.9 it
# truncates to float16 first and rounds that, a second rounding that can move an element one
# FP8 step from the reference; ROCm builds convert differently again. Those take the reference
# path, which gives the same bits as CPU.
_ONE_ROUNDING_FROM = (9, 0)


@functools.cache
def converts_in_one_rounding(index: int) -> bool:
    """Whether the fused cast's FP8 conversion rounds exactly as the reference on ``cuda:index``."""
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(index) >= _ONE_ROUNDING_FROM


def fused_kernel_available(x: torch.Tensor) -> bool:
    """Whether :func:`cast_and_record` runs the fused Triton kernel for ``x``."""
    return (
        x.dtype in _KERNEL_DTYPES and _kernel_layout(x) and converts_in_one_rounding(x.device.index)
    )


def kernels_available(device: torch.device) -> bool:
    """Whether fp8state's Triton kernels (updates, gathers) run for tensors on ``device``."""
    return device.type == "cuda" and _triton_installed()


def transpose_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` of a 2-D FP8 tensor, with one Triton kernel on CUDA."""
    if x.element_size() == 1 and _kernel_layout(x):
        from fp8state._kernels.triton_transpose import transpose_bytes

        return transpose_bytes(x)
    return x.t().contiguous()


def cast_and_record(
    x_2d: torch.Tensor,
    scale: torch.Tensor,
    amax_cell: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``saturate(x * scale)`` in ``fp8_dtype``, its transpose if asked, and the amax record.

    Args:
        x_2d: 2-D high-precision operand.
        scale: 1-element float32 scale of the operand's slot.
        amax_cell: 1-element float32 view of the slot's current history cell; it becomes
            ``max(amax_cell, max(|x|))`` over the finite elements of ``x``.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        transpose: Also return the contiguous transpose (the layout FP8 GEMMs need for the
            operand's other use in backward).

    Returns:
        ``(x_fp8, x_fp8_t or None)``.
    """
    if fused_kernel_available(x_2d):
        from fp8state._kernels.cast_launch import cast_transpose_amax

        return cast_transpose_amax(x_2d, scale, fp8_dtype, amax_cell, transpose)
    amax_cell.copy_(torch.maximum(amax_cell, finite_amax(x_2d)))
    x_fp8 = quantize(x_2d, scale, fp8_dtype)
    return x_fp8, (x_fp8.t().contiguous() if transpose else None)


def cast_slot(
    x_2d: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    history: torch.Tensor,
    slot: int,
    fp8_dtype: torch.dtype,
    *,
    transpose: bool,
    new_step: bool,
    column_sums: bool = False,
    op: str = "identity",
    aux: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """:func:`cast_and_record` for one slot of a direction's live buffers, step-aware.

    The modules' hot path: on CUDA one kernel launch shifts the history when ``new_step``
    (:func:`fp8state.scaling.shift_history`), casts with ``scale[slot]``, records the amax into
    row 0, snapshots ``scale_inv[slot]`` and, if asked, sums the columns, with no slicing,
    shifting or copying launched from Python.

    Args:
        x_2d: 2-D high-precision operand.
        scale: The direction's ``(n,)`` float32 scales.
        scale_inv: The direction's ``(n,)`` float32 inverse scales.
        history: The direction's ``(rows, n)`` float32 amax history.
        slot: The operand's slot.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        transpose: Also return the contiguous transpose.
        new_step: First record of the direction since its last scale update.
        column_sums: Also return the column sums of what is cast (a bias gradient), as
            ``Tensor.sum`` does: in the input's dtype with ``op="identity"``, float32
            otherwise (accumulated in float32 either way).
        op: What is cast, in float32, without rounding to the input's dtype in between:
            ``"identity"``, ``"gelu"`` (tanh approximation) of ``x_2d``, or ``"dgelu"``:
            ``x_2d`` (a gradient) times GELU's derivative at ``aux``.
        aux: The activation's input for ``"dgelu"``, shaped like ``x_2d``.

    Returns:
        ``(x_fp8, x_fp8_t or None, scale_inv_snapshot, column sums or None)``: the snapshot
        is a 1-element copy of ``scale_inv[slot]`` taken before the step's scale update can
        change it.
    """
    if op not in CAST_OPS or (op == "dgelu") != (aux is not None):
        raise ConfigError(
            "cast_slot(op=...)",
            f"{op!r} (aux given: {aux is not None})",
            "'identity' or 'gelu' without aux, 'dgelu' with aux",
            "Pass one of the supported ops (this is a bug in the caller).",
        )
    kernel = (
        fused_kernel_available(x_2d)
        and history.is_contiguous()
        and scale.is_contiguous()
        and scale_inv.is_contiguous()
    )
    # The kernel shifts in-launch (a captured launch too, with the history's scratch pair);
    # the reference path shifts with plain tensor ops first.
    if new_step and not kernel:
        history.copy_(shift_history(history))
        new_step = False
    if kernel:
        from fp8state._kernels import cast_launch

        return cast_launch.cast_slot(
            x_2d,
            scale,
            scale_inv,
            history,
            slot,
            fp8_dtype,
            transpose=transpose,
            new_step=new_step,
            column_sums=column_sums,
            op=op,
            aux=None if aux is None else aux.contiguous(),
        )
    x_2d = apply_op(x_2d, op, aux)
    x_fp8, x_fp8_t = cast_and_record(
        x_2d, scale[slot : slot + 1], history[0, slot : slot + 1], fp8_dtype, transpose=transpose
    )
    sums = x_2d.sum(dim=0) if column_sums else None
    return x_fp8, x_fp8_t, scale_inv[slot : slot + 1].clone(), sums
