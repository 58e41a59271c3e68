"""One-pass FP8 cast on CUDA: amax, quantize and (optionally) the transposed copy together.

Reads the high-precision tensor once and writes the FP8 tensor, its transpose if asked (the
layout FP8 GEMMs need for the other operand of backward), and ``max(|x|)`` over finite
elements, max-combined into a float32 cell in place (the slot's history row 0), so no separate
amax or transpose pass runs. Each program walks ``BLOCK_M`` whole rows and does one atomic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["cast_transpose_amax", "default_config"]


@triton.jit
def _cast_kernel(
    x_ptr, out_ptr, out_t_ptr, scale_ptr, amax_ptr, M, N, fp8_max,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    scale = tl.load(scale_ptr)
    running = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        ax = tl.abs(x)
        running = tl.maximum(running, tl.where(ax < float("inf"), ax, 0.0))  # drops inf, NaN
        scaled = x * scale
        # Saturate like torch.clamp, keeping NaN (hardware min/max would turn it into a bound).
        y = tl.where(scaled != scaled, scaled, tl.minimum(tl.maximum(scaled, -fp8_max), fp8_max))
        y = y.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], y, mask=mask)
        if TRANSPOSE:
            tl.store(out_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(y),
                     mask=tl.trans(mask))
    tl.atomic_max(amax_ptr, tl.max(tl.max(running, axis=1), axis=0))


def default_config(rows: int, transpose: bool) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` measured fastest on an H200 for 16384x4096 bf16.

    benchmarks/profile_linear.py: without transpose, (8, 256, 8) moved 3.7 TB/s (the copy
    bandwidth); with it, (32, 128, 8) moved 2.4 TB/s, wider row blocks making the transposed
    stores longer. Smaller tensors get smaller row blocks so every SM has programs.
    """
    block_m, block_n = (32, 128) if transpose else (8, 256)
    while block_m > 8 and triton.cdiv(rows, block_m) < 512:
        block_m //= 2
    return block_m, block_n, 8


def cast_transpose_amax(
    x_2d: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax_cell: torch.Tensor,
    transpose: bool,
    config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FP8 copy of a contiguous 2-D CUDA tensor (and its transpose); amax into ``amax_cell``.

    Args:
        x_2d: ``(M, N)`` contiguous, bf16/fp16/fp32, on CUDA.
        scale: 1-element float32 scale on the same device.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        amax_cell: 1-element float32 tensor (a view into the history), >= 0; receives
            ``max(amax_cell, max(|x| over finite x))``.
        transpose: Also return the ``(N, M)`` contiguous transpose.
        config: ``(BLOCK_M, BLOCK_N, num_warps)``; default from :func:`default_config`
            (benchmarks/profile_linear.py sweeps the alternatives).
    """
    m, n = x_2d.shape
    out = torch.empty((m, n), dtype=fp8_dtype, device=x_2d.device)
    out_t = torch.empty((n, m), dtype=fp8_dtype, device=x_2d.device) if transpose else out
    block_m, block_n, warps = config or default_config(m, transpose)
    # Triton launches on the current device; the tensors may live on another GPU.
    with torch.cuda.device(x_2d.device):
        _cast_kernel[(triton.cdiv(m, block_m),)](
            x_2d, out, out_t, scale, amax_cell, m, n, float(torch.finfo(fp8_dtype).max),
            BLOCK_M=block_m, BLOCK_N=block_n, TRANSPOSE=transpose, num_warps=warps,
        )
    return out, (out_t if transpose else None)
