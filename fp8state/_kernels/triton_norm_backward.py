"""LayerNorm's and RMSNorm's backward on CUDA in one pass over its inputs.

Given the gradient of the norm's output ``dy``, its input ``x`` and the rows' mean (LayerNorm
only) and reciprocal standard deviation (RMSNorm: of the root mean square) saved by the forward
(:mod:`fp8state._kernels.triton_norm_cast`), each program walks ``span`` rows, ``BLOCK_M`` at
a time, with whole rows in registers: it writes the input's gradient and keeps the weight's
and bias's gradients (column sums of ``dy * x_hat`` and, with a bias, ``dy``) in registers,
storing one partial row of each at the end. A second launch sums the partial rows in a fixed
order (bit-reproducible) straight into the parameters' dtype (:func:`param_grads_kernel`;
``Tensor.sum`` over them took 7.7 us a step's norm at 2048 columns).
:mod:`fp8state._kernels.norm_launch` launches both.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["norm_backward_kernel", "param_grads_kernel"]


@triton.jit
def norm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    partial_ptr,
    M,
    N,
    span,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARAMS: tl.constexpr,
    RMS: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    in_cols = cols < N
    w = tl.load(w_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid * span
    for start in range(first, tl.minimum(first + span, M), BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        in_rows = rows < M
        mask = in_rows[:, None] & in_cols[None, :]
        offsets = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=in_rows, other=0.0)
        g = dy * w[None, :]
        if RMS:  # masked elements are 0 in x, hence in x_hat
            x_hat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=in_rows, other=0.0)
            x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        # d/dx of (x - mean) * rstd, applied to g: rstd * (g - mean(g) - x_hat * mean(g x_hat));
        # RMSNorm's has no mean(g) term (nothing was subtracted).
        c_hat = tl.sum(g * x_hat, axis=1) / N
        if RMS:
            dx = (g - x_hat * c_hat[:, None]) * rstd[:, None]
        else:
            c_one = tl.sum(g, axis=1) / N
            dx = (g - c_one[:, None] - x_hat * c_hat[:, None]) * rstd[:, None]
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if PARAMS:
            dw += dy * x_hat
            if not RMS:
                db += dy
    if PARAMS:
        # Partial rows (pid, 0) and (pid, 1) of the (programs, 2, N) float32 buffer.
        base = partial_ptr + pid * 2 * N + cols
        tl.store(base, tl.sum(dw, axis=0), mask=in_cols)
        if not RMS:
            tl.store(base + N, tl.sum(db, axis=0), mask=in_cols)


@triton.jit
def param_grads_kernel(
    partial_ptr,
    dw_ptr,
    db_ptr,
    programs,
    N,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Sum the partial rows, in program order, into the weight's and the bias's gradients.

    Program ``(pid, which)`` sums ``BLOCK_N`` columns of the weight's rows (``which`` 0) or
    the bias's (1), ``BLOCK_P`` rows at a time, and stores them in the parameter's dtype.
    """
    pid, which = tl.program_id(0), tl.program_id(1)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N
    total = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < programs)[:, None] & in_cols[None, :]
        offsets = rows[:, None] * 2 * N + which * N + cols[None, :]
        total += tl.load(partial_ptr + offsets, mask=mask, other=0.0)
    sums = tl.sum(total, axis=0)
    if which == 0:
        tl.store(dw_ptr + cols, sums.to(dw_ptr.dtype.element_ty), mask=in_cols)
    else:
        tl.store(db_ptr + cols, sums.to(db_ptr.dtype.element_ty), mask=in_cols)
