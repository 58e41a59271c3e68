"""The host side of a norm fused with the FP8 cast, and of the norm's backward.

Kernels: :mod:`fp8state._kernels.triton_norm_cast` (forward) and
:mod:`fp8state._kernels.triton_norm_backward`. Block shapes and program counts were timed on
an H200 (``python benchmarks/norm_cast_probe.py``, bf16 2048x2048, 8192x2048 and 8192x4096).
Forward: two rows at a time per program up to 4096 columns, about 528 programs at 2048
columns and proportionally fewer for wider rows (2048x2048 6.8 us and 8192x2048 21.7 us,
against 9.6 and 32.8 for ``F.layer_norm`` alone). Backward: 264 programs of eight warps,
two rows at a time up to 2048 columns (8192x2048 42.7 us with the partial rows summed by
``Tensor.sum``, against 75.7 for ``native_layer_norm_backward``); a kernel of its own sums
them now (3.5 us a norm at 2048x2048 in the 16-layer model's step, against 7.7 for
``Tensor.sum`` and its conversions). RMSNorm takes the same plans (the same registers and
passes, less arithmetic).
"""

from __future__ import annotations

import functools

import torch
import triton

from fp8state._kernels.cast_launch import history_blocks
from fp8state._kernels.launch import FastLauncher, int_spec, ptr_aligned
from fp8state._kernels.scratch import scratch_pair
from fp8state._kernels.triton_norm_backward import norm_backward_kernel, param_grads_kernel
from fp8state._kernels.triton_norm_cast import norm_cast_kernel

__all__ = ["MAX_COLUMNS", "norm_backward", "norm_cast_slot"]

# Whole rows live in registers: wider rows would spill, and take the separate kernels.
MAX_COLUMNS = 16384
_FORWARD = FastLauncher(norm_cast_kernel)
_BACKWARD = FastLauncher(norm_backward_kernel)
_SUMS = FastLauncher(param_grads_kernel)
_SUM_ROWS, _SUM_COLUMNS = 64, 32  # partial rows per load, columns per summing program


@functools.lru_cache(maxsize=256)
def _forward_plan(m: int, n: int, opening: bool = False) -> tuple[int, int, int, int, int]:
    """``(programs, span, BLOCK_M, BLOCK_N, warps)`` of the forward for an ``(m, n)`` input.

    ``opening``: for a launch that opens a step. Each of its programs ends on a fenced count
    (:func:`fp8state._kernels.triton_record.count_done`), a wait that every wave of programs
    pays again. Two-row blocks of 2048 columns take 214-219 registers a thread (ptxas for
    sm_90), two programs an SM, so 512 programs run in two waves; one-row blocks take 164-168,
    three an SM. On an H100 (``python benchmarks/norm_cast_probe.py --opening --shapes
    2048x2048 4096x2048 8192x2048``), opening launches of one-row blocks took 8.1 us at
    2048x2048 and 12.1 at 4096x2048 against 10.3 and 15.5 for two-row ones; later records
    keep the two-row blocks, faster there (6.6 against 6.9 us, 10.5 against 11.3), as do
    taller inputs (8192x2048: 25.3 against 30.1 us opening).
    """
    block_n = triton.next_power_of_2(n)
    block_m = 2 if block_n <= 4096 else 1
    if opening and block_n == 2048 and m <= 4096:
        block_m = 1
    warps = 4 if block_m * block_n <= 8192 else 8
    target = max(132, 528 * 2048 // max(block_n, 2048))
    span = triton.cdiv(triton.cdiv(m, target), block_m) * block_m
    return triton.cdiv(m, span), span, block_m, block_n, warps


@functools.lru_cache(maxsize=256)
def _backward_plan(m: int, n: int) -> tuple[int, int, int, int]:
    """``(programs, span, BLOCK_M, BLOCK_N)`` of the backward (eight warps)."""
    block_n = triton.next_power_of_2(n)
    block_m = 2 if block_n <= 2048 else 1
    span = triton.cdiv(triton.cdiv(m, 264), block_m) * block_m
    return triton.cdiv(m, span), span, block_m, block_n


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
    new_step: bool,
    rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """LayerNorm (``rms``: RMSNorm) of ``x_2d`` cast with ``scale[slot]``, its amax recorded.

    Args as :func:`fp8state._kernels.cast_launch.cast_slot` (``x_2d`` contiguous, at most
    :data:`MAX_COLUMNS` columns), plus the norm's ``weight``, ``bias`` (contiguous, length
    ``x_2d.shape[1]``; None for RMSNorm) and ``eps``.

    Returns:
        ``(x_fp8, scale_inv snapshot, mean, rstd)``: the rows' mean (None for RMSNorm) and
        reciprocal standard deviation (RMSNorm: of the root mean square) as float32
        ``(M, 1)``, as ``torch.native_layer_norm`` returns them.
    """
    m, n = x_2d.shape
    device = x_2d.device
    programs, span, block_m, block_n, warps = _forward_plan(m, n, new_step)
    out = torch.empty((m, n), dtype=fp8_dtype, device=device)
    inv_out = torch.empty(1, dtype=torch.float32, device=device)
    rstd = torch.empty((m, 1), dtype=torch.float32, device=device)
    mean = None if rms else torch.empty((m, 1), dtype=torch.float32, device=device)
    scratch = scratch_pair(history) if new_step else scale
    has_bias = bias is not None
    bias_t = bias if bias is not None else weight
    slots_block, chunk = history_blocks(history.shape[-1])
    key = (
        block_m,
        block_n,
        warps,
        slots_block,
        *map(int_spec, (m, n, span)),
        x_2d.dtype,
        weight.dtype,
        bias_t.dtype,
        fp8_dtype,
        has_bias,
        rms,
        new_step,
        ptr_aligned(x_2d),
        ptr_aligned(weight),
        ptr_aligned(bias_t),
        ptr_aligned(scale),
        ptr_aligned(scale_inv),
        ptr_aligned(history),
    )
    _FORWARD(
        key,
        (programs + new_step,),  # one more program shifts the history (triton_record)
        (
            x_2d,
            weight,
            bias_t,
            out,
            rstd if mean is None else mean,  # RMSNorm stores no mean
            rstd,
            scale,
            scale_inv,
            inv_out,
            history,
            scratch,
            slot,
            history.shape[-1],
            history.shape[0],
            m,
            n,
            span,
            eps,
            block_m,
            block_n,
            has_bias,
            rms,
            new_step,
            slots_block,
            chunk,
        ),  # fmt: skip
        device,
        num_warps=warps,
    )
    return out, inv_out, mean, rstd


def norm_backward(
    grad: torch.Tensor,
    x_2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    params: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The norm's input gradient and, if ``params``, its weight's and bias's gradients.

    ``grad`` and ``x_2d`` are contiguous ``(M, N)`` tensors of one dtype, ``mean`` and
    ``rstd`` the forward's (:func:`norm_cast_slot`; no ``mean``: RMSNorm's); the parameters'
    gradients come in the parameters' dtypes (the bias's is None without a bias).
    """
    m, n = x_2d.shape
    device = x_2d.device
    programs, span, block_m, block_n = _backward_plan(m, n)
    dx = torch.empty_like(x_2d)
    partial = torch.empty((programs, 2, n), dtype=torch.float32, device=device) if params else dx
    key = (
        block_m,
        block_n,
        params,
        mean is None,
        *map(int_spec, (m, n, span)),
        x_2d.dtype,
        grad.dtype,
        weight.dtype,
        ptr_aligned(grad),
        ptr_aligned(x_2d),
        ptr_aligned(weight),
    )
    _BACKWARD(
        key,
        (programs,),
        (
            grad,
            x_2d,
            weight,
            rstd if mean is None else mean,  # an unread stand-in for RMSNorm
            rstd,
            dx,
            partial,
            m,
            n,
            span,
            block_m,
            block_n,
            params,
            mean is None,  # RMS: no mean, no centering
        ),
        device,
        num_warps=8,
    )
    if not params:
        return dx, None, None
    dw = torch.empty_like(weight)
    db = torch.empty_like(bias) if bias is not None else dw
    sum_key = (weight.dtype, db.dtype, *map(int_spec, (programs, n)))
    _SUMS(
        sum_key,
        (triton.cdiv(n, _SUM_COLUMNS), 1 if bias is None else 2),
        (partial, dw, db, programs, n, _SUM_ROWS, _SUM_COLUMNS),
        device,
        num_warps=4,
    )
    return dx, dw, (db if bias is not None else None)
