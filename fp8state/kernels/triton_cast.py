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

from fp8state.kernels._launch import FastLauncher, int_spec, ptr_aligned, raw_stream

__all__ = ["cast_transpose_amax", "cast_slot", "default_config"]


@triton.jit
def _open_step(hist_ptr, slot, n_slots, hist_rows, amax, SLOTS: tl.constexpr,
               CHUNK: tl.constexpr):
    """Shift the history down one row, zero row 0, write ``amax`` into row 0 of ``slot``.

    Run by one program only, after every other program has finished with the history.
    Chunks go from the bottom up so that each row is read before the chunk below overwrites
    it; the barriers order each chunk's loads before its stores across the program's threads.
    """
    cols = tl.arange(0, SLOTS)
    in_row = cols < n_slots
    for done in range(0, hist_rows - 1, CHUNK):  # a positive step: Triton loops need one
        dst = hist_rows - 1 - done - tl.arange(0, CHUNK)
        mask = (dst >= 1)[:, None] & in_row[None, :]
        moved = tl.load(hist_ptr + (dst - 1)[:, None] * n_slots + cols[None, :], mask=mask)
        tl.debug_barrier()
        tl.store(hist_ptr + dst[:, None] * n_slots + cols[None, :], moved, mask=mask)
        tl.debug_barrier()
    tl.store(hist_ptr + cols, tl.where(cols == slot, amax, 0.0), mask=in_row)


@triton.jit(do_not_specialize=["slot", "n_slots", "hist_rows"])
def _cast_kernel(
    x_ptr, out_ptr, out_t_ptr, scale_ptr, inv_ptr, inv_out_ptr, hist_ptr, scratch_ptr,
    slot, n_slots, hist_rows, M, N, fp8_max,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSE: tl.constexpr,
    SNAPSHOT: tl.constexpr, SHIFT: tl.constexpr, SLOTS: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    scale = tl.load(scale_ptr + slot)
    if SNAPSHOT:  # the inverse scale as of this cast, for backward (the live one moves on)
        tl.store(inv_out_ptr, tl.load(inv_ptr + slot), mask=pid == 0)
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
    amax = tl.max(tl.max(running, axis=1), axis=0)
    if SHIFT:
        # First record of a step: the history must shift before row 0 takes this amax, and
        # other programs are still running. Each program max-combines its amax into scratch
        # (as int bits: same order as the floats, all >= 0) and counts itself done; the last
        # one shifts and writes, then resets scratch for the next launch on this stream.
        tl.atomic_max(scratch_ptr, amax.to(tl.int32, bitcast=True))
        done = tl.atomic_add(scratch_ptr + 1, 1)
        if done == tl.num_programs(0) - 1:
            total = tl.atomic_xchg(scratch_ptr, 0).to(tl.float32, bitcast=True)
            tl.atomic_xchg(scratch_ptr + 1, 0)
            _open_step(hist_ptr, slot, n_slots, hist_rows, total, SLOTS, CHUNK)
    else:
        tl.atomic_max(hist_ptr + slot, amax)


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
    out, out_t, _ = _launch(x_2d, scale, scale, amax_cell, 0, 1, fp8_dtype, transpose,
                            snapshot=False, new_step=False, config=config)
    return out, out_t


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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Cast with slot ``slot``'s scale and record its amax, all in one launch.

    Args:
        x_2d: ``(M, N)`` contiguous, bf16/fp16/fp32, on CUDA.
        scale: The direction's ``(n,)`` float32 scales (contiguous, same device).
        scale_inv: The direction's ``(n,)`` float32 inverse scales.
        history: The direction's ``(rows, n)`` float32 amax history.
        slot: Which column of the three the operand uses.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        transpose: Also return the ``(N, M)`` contiguous transpose.
        new_step: This is the direction's first record since its last scale update: the
            history shifts down one row first (``scaling.shift_history``), in the same launch.

    Returns:
        ``(x_fp8, x_fp8_t or None, scale_inv_snapshot)``, the last a 1-element copy of
        ``scale_inv[slot]`` as it was when the cast ran.
    """
    return _launch(x_2d, scale, scale_inv, history, slot, history.shape[-1], fp8_dtype,
                   transpose, snapshot=True, new_step=new_step)


# One int32 pair (amax bits, programs done) per device and stream: launches on one stream run
# one after another, and each launch leaves its pair zeroed for the next.
_SCRATCH: dict[tuple[int, int], torch.Tensor] = {}
_LAUNCHER = FastLauncher(_cast_kernel)


_FP8_MAX = {dtype: float(torch.finfo(dtype).max)
            for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}


def _scratch(device: torch.device) -> torch.Tensor:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, raw_stream(index))
    pair = _SCRATCH.get(key)
    if pair is None:
        pair = _SCRATCH[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return pair


def _launch(
    x_2d: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor, history: torch.Tensor,
    slot: int, n_slots: int, fp8_dtype: torch.dtype, transpose: bool, *, snapshot: bool,
    new_step: bool, config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    m, n = x_2d.shape
    device = x_2d.device
    out = torch.empty((m, n), dtype=fp8_dtype, device=device)
    out_t = torch.empty((n, m), dtype=fp8_dtype, device=device) if transpose else out
    inv_out = torch.empty(1, dtype=torch.float32, device=device) if snapshot else scale
    scratch = _scratch(device) if new_step else scale
    block_m, block_n, warps = config or default_config(m, transpose)
    slots_block = triton.next_power_of_2(max(n_slots, 2))
    chunk = max(1, 2048 // slots_block)
    rows = history.shape[0] if history.dim() == 2 else 1
    key = (x_2d.dtype, fp8_dtype, block_m, block_n, warps, transpose, snapshot, new_step,
           slots_block, int_spec(m), int_spec(n), ptr_aligned(x_2d), ptr_aligned(scale),
           ptr_aligned(scale_inv), ptr_aligned(history))
    _LAUNCHER(key, (triton.cdiv(m, block_m),), (
        x_2d, out, out_t, scale, scale_inv, inv_out, history, scratch, slot, n_slots, rows,
        m, n, _FP8_MAX[fp8_dtype], block_m, block_n, transpose, snapshot,
        new_step, slots_block, chunk,
    ), device, num_warps=warps)
    return out, (out_t if transpose else None), inv_out
