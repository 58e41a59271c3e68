"""A norm (LayerNorm or RMSNorm) and the FP8 cast of its output, in one pass on CUDA.

A norm followed by an FP8 GEMM (``LayerNormLinear``, ``LayerNormMLP``) would write the norm's
output in high precision only for the cast to read it back. Here each program walks ``span``
rows, ``BLOCK_M`` at a time, whole rows held in registers (``BLOCK_N >= N`` columns): it
normalizes them (``RMS``: divides by the root mean square, no centering and no bias), rounds
the result to the input's dtype (what the norm returns, so the FP8 bits are those of the cast
of that output) and casts it with the slot's scale. It writes the FP8 rows (no transposed
copy: the one-byte transpose makes it), the rows' reciprocal standard deviation (RMSNorm: of
the root mean square) and, for LayerNorm, their mean (what the norm's backward takes) and
the inverse scale's snapshot, and records the amax as every cast does
(:mod:`fp8state._kernels.triton_record`). :mod:`fp8state._kernels.norm_launch` launches it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp8state._kernels.triton_record import count_done, record_amax, shift_history

__all__ = ["norm_cast_kernel"]


@triton.jit
def _norm_cast_rows(
    pid,
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    mean_ptr,
    rstd_ptr,
    scale_ptr,
    inv_ptr,
    inv_out_ptr,
    slot,
    M,
    N,
    span,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr,
):
    """Program ``pid``'s ``span`` rows, ``BLOCK_M`` at a time; returns their amax."""
    cols = tl.arange(0, BLOCK_N)
    in_cols = cols < N
    w = tl.load(w_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
    b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + slot)
    # The inverse scale as of this cast, for backward (the live one moves on).
    tl.store(inv_out_ptr, tl.load(inv_ptr + slot), mask=pid == 0)
    running = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid * span
    for start in range(first, tl.minimum(first + span, M), BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        in_rows = rows < M
        mask = in_rows[:, None] & in_cols[None, :]
        offsets = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if RMS:  # masked elements loaded as 0 add nothing to the mean square
            centered = x
        else:  # two passes over registers, as the definition reads (no running moments)
            mean = tl.sum(x, axis=1) / N
            centered = tl.where(mask, x - mean[:, None], 0.0)
            tl.store(mean_ptr + rows, mean, mask=in_rows)
        rstd = libdevice.rsqrt(tl.sum(centered * centered, axis=1) / N + eps)
        tl.store(rstd_ptr + rows, rstd, mask=in_rows)
        y = centered * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += b[None, :]
        # The norm's output as the norm returns it, in the input's dtype: the cast is of that.
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        ax = tl.abs(y)
        # Rows past M normalize to the bias: only the tensor's own finite values count.
        running = tl.maximum(running, tl.where(mask & (ax < float("inf")), ax, 0.0))
        # The conversion saturates as the cast kernel's does (triton_cast._cast_tile).
        tl.store(out_ptr + offsets, (y * scale).to(out_ptr.dtype.element_ty), mask=mask)
    return tl.max(tl.max(running, axis=1), axis=0)


@triton.jit(do_not_specialize=["slot", "n_slots", "hist_rows"])
def norm_cast_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    mean_ptr,
    rstd_ptr,
    scale_ptr,
    inv_ptr,
    inv_out_ptr,
    hist_ptr,
    scratch_ptr,
    slot,
    n_slots,
    hist_rows,
    M,
    N,
    span,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr,
    SHIFT: tl.constexpr,
    SLOTS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # A 1-D grid of row ranges and, with SHIFT, one program ahead of them that only shifts
    # the history (as triton_cast.cast_kernel's).
    pid = tl.program_id(0)
    if SHIFT:
        pid = pid - 1
    if pid >= 0:
        amax = _norm_cast_rows(
            pid, x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, scale_ptr, inv_ptr,
            inv_out_ptr, slot, M, N, span, eps, BLOCK_M, BLOCK_N, HAS_BIAS, RMS,
        )  # fmt: skip
        record_amax(amax, scratch_ptr, hist_ptr, slot, SHIFT)
    elif SHIFT:
        shift_history(hist_ptr, n_slots, hist_rows, SLOTS, CHUNK)
    if SHIFT:
        count_done(scratch_ptr, hist_ptr, slot, n_slots, SLOTS)
