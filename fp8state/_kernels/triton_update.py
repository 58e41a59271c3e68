"""Delayed-scaling update on CUDA: window amax, scale and scale_inv, for many modules at once.

Computes exactly what :func:`fp8state.scaling.update_scale` computes, with the same float32
operations in the same order (IEEE-rounded divisions, the same clamps), so the results are
bit-identical. :func:`update_scales_` serves one module and direction in one launch instead of
about ten; :func:`batched_update_scales_` serves any number of modules in one launch, reading
each module's buffers through a table of pointers (no concatenation, no copies back).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from fp8state._kernels.addresses import AddressTable
from fp8state._kernels.launch import FastLauncher, int_spec, ptr_aligned
from fp8state.scaling import FLOAT32_MAX, FLOAT32_TINY

__all__ = ["update_scales_", "batched_update_scales_", "PointerTable"]


@triton.jit
def _new_scale(
    hist,
    scale_ptr,
    inv_ptr,
    cols,
    mask,
    n,
    window,
    fp8_max,
    margin,
    MOST_RECENT: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    f32_tiny,
    f32_max,
):
    amax = tl.load(hist + cols, mask=mask, other=0.0)
    if not MOST_RECENT:
        # ROWS rows per load: one row at a time made 1024 dependent loads (~75 us a launch).
        # A max is exact in any order, so this stays bit-identical to the reference.
        rows = tl.arange(0, ROWS)
        for start in range(1, window, ROWS):
            r = start + rows
            tile = tl.load(
                hist + r[:, None] * n + cols[None, :],
                mask=(r < window)[:, None] & mask[None, :],
                other=0.0,
            )
            amax = tl.maximum(amax, tl.max(tile, axis=0))
    prev = tl.load(scale_ptr + cols, mask=mask, other=1.0)
    scale = tl.math.div_rn(tl.full([BLOCK], fp8_max, tl.float32), amax)
    remaining = margin
    while remaining > 0:
        step = tl.minimum(remaining, 126)
        # 2**step built from its exponent bits: exact, unlike an exp2 approximation.
        power = ((step + 127) << 23).to(tl.float32, bitcast=True)
        scale = tl.math.div_rn(scale, power)
        remaining -= step
    scale = tl.minimum(tl.maximum(scale, f32_tiny), f32_max)
    usable = (amax > 0.0) & (amax < float("inf"))
    scale = tl.where(usable, scale, prev)
    tl.store(scale_ptr + cols, scale, mask=mask)
    tl.store(inv_ptr + cols, tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), scale), mask=mask)


@triton.jit
def _update_kernel(
    hist_ptr,
    scale_ptr,
    inv_ptr,
    n,
    window,
    fp8_max,
    margin,
    MOST_RECENT: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    f32_tiny,
    f32_max,
):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _new_scale(
        hist_ptr,
        scale_ptr,
        inv_ptr,
        cols,
        cols < n,
        n,
        window,
        fp8_max,
        margin,
        MOST_RECENT,
        BLOCK,
        ROWS,
        f32_tiny,
        f32_max,
    )


@triton.jit
def _batched_kernel(
    hist_ptrs,
    scale_ptrs,
    inv_ptrs,
    ns,
    windows,
    fp8_max,
    margin,
    MOST_RECENT: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    f32_tiny,
    f32_max,
):
    pid = tl.program_id(0)
    n = tl.load(ns + pid)
    window = tl.load(windows + pid)
    hist = tl.load(hist_ptrs + pid).to(tl.pointer_type(tl.float32))
    scale_ptr = tl.load(scale_ptrs + pid).to(tl.pointer_type(tl.float32))
    inv_ptr = tl.load(inv_ptrs + pid).to(tl.pointer_type(tl.float32))
    cols = tl.arange(0, BLOCK)
    _new_scale(
        hist,
        scale_ptr,
        inv_ptr,
        cols,
        cols < n,
        n,
        window,
        fp8_max,
        margin,
        MOST_RECENT,
        BLOCK,
        ROWS,
        f32_tiny,
        f32_max,
    )


def _rows_per_load(block: int, window: int) -> int:
    """History rows read per load: a tile of about 4096 floats, no more rows than the window."""
    return max(1, min(triton.next_power_of_2(max(window, 1)), 4096 // block))


def update_scales_(
    history: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    window: int,
    algo: str,
    fp8_max: float,
    margin: int,
) -> None:
    """In place: ``scale, scale_inv = scaling.update_scale(history, scale, ...)``.

    Args:
        history: ``(rows, n)`` contiguous float32 CUDA tensor, row 0 most recent.
        scale: ``(n,)`` contiguous float32, read as the previous scale and overwritten.
        scale_inv: ``(n,)`` contiguous float32, overwritten.
        window: Rows the ``"max"`` algorithm reads.
        algo: ``"max"`` or ``"most_recent"``.
        fp8_max: Largest value of the direction's FP8 dtype.
        margin: ``DelayedScaling.margin``.
    """
    n, rows = history.shape[1], history.shape[0]
    block, window, loads, margin, specs = _update_plan(n, rows, window, int(margin))
    key = (
        specs,
        algo == "most_recent",
        ptr_aligned(history),
        ptr_aligned(scale),
        ptr_aligned(scale_inv),
    )
    _UPDATE(
        key,
        (triton.cdiv(n, block),),
        (
            history,
            scale,
            scale_inv,
            n,
            window,
            float(fp8_max),
            margin,
            algo == "most_recent",
            block,
            loads,
            FLOAT32_TINY,
            FLOAT32_MAX,
        ),
        history.device,
    )


@functools.lru_cache(maxsize=256)
def _update_plan(n: int, rows: int, window: int, margin: int) -> tuple[Any, ...]:
    """Block sizes and specializations of :func:`update_scales_` (cached: runs per step)."""
    block = min(1024, triton.next_power_of_2(max(n, 16)))
    window = min(window, rows)
    margin = min(margin, 300)
    loads = _rows_per_load(block, window)
    return (
        block,
        window,
        loads,
        margin,
        (block, loads, int_spec(n), int_spec(window), int_spec(margin)),
    )


_UPDATE = FastLauncher(_update_kernel)


class PointerTable(AddressTable):
    """Device-side addresses of many modules' buffers, built once and reused every step.

    Valid only while those exact tensors are the modules' buffers; the caller rebuilds it
    when any buffer is replaced (``FP8StateMixin`` counts such replacements) or moved
    (:meth:`still_valid`).
    """

    def __init__(
        self,
        histories: Sequence[torch.Tensor],
        scales: Sequence[torch.Tensor],
        scale_invs: Sequence[torch.Tensor],
        window: int,
    ) -> None:
        super().__init__([*histories, *scales, *scale_invs])
        device = histories[0].device
        self.count = len(histories)
        self.block = triton.next_power_of_2(max(16, max(h.shape[1] for h in histories)))
        self.hist = self.addresses(histories, device)
        self.scale = self.addresses(scales, device)
        self.inv = self.addresses(scale_invs, device)
        self.ns = torch.tensor([h.shape[1] for h in histories], dtype=torch.int32, device=device)
        windows = [min(window, h.shape[0]) for h in histories]
        self.rows = _rows_per_load(self.block, max(windows))
        self.windows = torch.tensor(windows, dtype=torch.int32, device=device)


def batched_update_scales_(table: PointerTable, *, algo: str, fp8_max: float, margin: int) -> None:
    """:func:`update_scales_` for every module of ``table``, in one launch."""
    # Triton launches on the current device; the tensors may live on another GPU.
    with torch.cuda.device(table.hist.device):
        _batched_kernel[(table.count,)](
            table.hist,
            table.scale,
            table.inv,
            table.ns,
            table.windows,
            float(fp8_max),
            min(int(margin), 300),
            MOST_RECENT=algo == "most_recent",
            BLOCK=table.block,
            ROWS=table.rows,
            f32_tiny=FLOAT32_TINY,
            f32_max=FLOAT32_MAX,
        )
