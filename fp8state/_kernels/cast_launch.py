"""The host side of the one-pass FP8 cast: block shapes and the launch.

The kernel itself is :mod:`fp8state._kernels.triton_cast`, the buffers it gathers in
:mod:`fp8state._kernels.scratch`; this file picks its configuration for a tensor's shape
(:func:`default_config`) and launches it through the fast launcher
(:func:`cast_transpose_amax`, :func:`cast_slot`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton

from fp8state._kernels.launch import FastLauncher, int_spec, ptr_aligned
from fp8state._kernels.scratch import partial_rows, scratch_pair, tile_counts
from fp8state._kernels.triton_cast import OPS, cast_kernel

__all__ = ["cast_transpose_amax", "cast_slot", "default_config", "history_blocks"]


def default_config(
    rows: int, cols: int, transpose: bool, op: str = "identity", column_sums: bool = False
) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, split)`` for an ``(rows, cols)`` tensor.

    ``split``: how many programs share one row block's columns, each walking its share
    along the row; with ``column_sums``, how many share one column tile's rows, each walking
    its share down the column (so its sums stay in registers until the end).

    Measured on an H200 with ``benchmarks/profile_linear.py --sweep-only --cast-shape MxN
    [--column-sums] [--op OP]`` (16384x4096 and 16384x16384 bf16). Without the transpose,
    (8, 256, 8, 1) whole-row programs move 3.4-4.0 TB/s, the copy bandwidth. With it,
    (64, 128, 4, 8) moves 3.1-3.5 TB/s (whole-row programs: 2.4): taller blocks write longer
    runs of each transposed column and the column split gives every SM several programs.
    GELU's derivative (two inputs) likes 8 warps, GELU itself (more arithmetic per byte)
    smaller tiles. Smaller tensors get fewer rows per program. Column sums: eight programs
    walk down each 64-column tile, 3.3 TB/s without the transpose (about half that when
    programs walked along rows and reduced every tile across warps).

    Column sums with the transpose (every output gradient of a Linear with a bias), timed
    after the clamp left the kernel for bf16 operands (``--column-sums --configs ...``, each
    beside the rule it replaced: 32-row blocks, at most one program per 16 row blocks): 64-row
    blocks, and as many programs per column tile as keep them at 512 or fewer, a power of two.
    16384x4096: 83.4 against 99.6 us (3.2 TB/s); 16384x2048 45.7 against 59.1; 8192x2048 25.7
    against 30.6; 8192x6144 69.3 against 72.7 (six programs per tile instead of four: 80.1);
    2048x2048 9.3 against 9.6; 2048x6144 20.0-20.5 against 19.4-19.8, the one shape where the
    old rule was faster. GELU's derivative with sums, 128-column tiles of eight programs of 32-row
    blocks: 2048x8192 36.2 against 38.8 us for 16-row blocks, 8192x8192 115.1 against 120.8,
    16384x16384 427.6 against 424.3 (32 programs of 16 rows).

    Tensors of 2048 rows (a 2048-token step, the 16-layer model's; ``--cast-shape 2048xN``):
    with the transpose, 64-row blocks beat 32-row ones though only 256 programs ran (7.3 against
    9.3 us at 2048x2048, 27.9 against 31.0 at 2048x8192; sixteen per row block since, below).
    Column sums without the transpose: at most one program per 16 row blocks of a column tile,
    and no fewer than eight, before the narrow-tensor rule. Casts without the transpose: two
    programs per row block where there are fewer than 512 blocks (2048x8192: 18.1 against
    25.2 us, GELU 24.6 against 30.7; 2048x2048 alike, 6.1 and 6.2; at 8192x2048, 1024 blocks,
    one stays faster: 16.3 against 17.2). More programs per row block at 2048 rows, timed on
    a later lease (``--cast-shape 2048xN [--op gelu] --configs ...``, each beside the one it
    replaced): with the transpose, sixteen per 64-row block (2048x8192: 23.1 against 28.2 us;
    2048x2048 alike, 7.3 both); GELU without it, eight (2048x8192: 22.5 against 24.5). Other
    row counts keep the splits above.
    """
    if column_sums:
        if op == "dgelu":
            block_m, block_n, warps, split = 32, 128, 8, 8
        elif transpose:
            # A power of two: uneven shares of the rows were slower (above).
            block_m, block_n, warps = 64, 64, 4
            split = 1 << max(0, (512 // triton.cdiv(cols, block_n)).bit_length() - 1)
            return block_m, block_n, warps, max(1, min(split, triton.cdiv(rows, block_m)))
        else:
            block_m, block_n, warps, split = 64, 64, 8, 8
        # Shorter tensors: at most one program per 16 row blocks of a column tile (but not
        # fewer than eight), so each walks a longer share; the narrow rule may raise it again.
        split = min(split, max(8, triton.cdiv(rows, 16 * block_m)))
        # Narrow tensors: more programs per tile, so that there are some 512 in all.
        split = max(split, triton.cdiv(512, triton.cdiv(cols, block_n)))
        return block_m, block_n, warps, max(1, min(split, triton.cdiv(rows, block_m)))
    at_2048_rows = 2048 <= rows < 4096  # the 2048-row splits below were timed there only
    if not transpose:
        # Fewer than 512 row blocks: two programs share each row's columns; GELU's cast at
        # 2048 rows, eight (22.5 against 24.5 us at 2048x8192; other sizes not timed).
        block_m, block_n, warps = 8, 256, 8
        split = 1 if triton.cdiv(rows, block_m) >= 512 else 2
        if op == "gelu" and at_2048_rows:
            split = 8
    elif op == "gelu":
        block_m, block_n, warps, split = 32, 64, 8, 8
    else:
        block_m, block_n, warps, split = 64, 128, 8 if op == "dgelu" else 4, 8
        if op == "identity" and at_2048_rows:
            # Sixteen at 2048 rows: 512 programs instead of 256 (23.1 against 28.2 us at
            # 2048x8192, alike at 2048x2048); other row counts not timed with sixteen.
            split = 16
    while block_m > 8 and triton.cdiv(rows, block_m) * split < 256:
        block_m //= 2
    return block_m, block_n, warps, max(1, min(split, triton.cdiv(cols, block_n)))


def cast_transpose_amax(
    x_2d: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax_cell: torch.Tensor,
    transpose: bool,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FP8 copy of a contiguous 2-D CUDA tensor (and its transpose); amax into ``amax_cell``.

    Args:
        x_2d: ``(M, N)`` contiguous, bf16/fp16/fp32, on CUDA.
        scale: 1-element float32 scale on the same device.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        amax_cell: 1-element float32 tensor (a view into the history), >= 0; receives
            ``max(amax_cell, max(|x| over finite x))``.
        transpose: Also return the ``(N, M)`` contiguous transpose.
        config: ``(BLOCK_M, BLOCK_N, num_warps, split)``; default from
            :func:`default_config` (benchmarks/profile_linear.py sweeps the alternatives).
    """
    out, out_t, _, _ = _launch(
        x_2d,
        scale,
        scale,
        amax_cell,
        0,
        1,
        fp8_dtype,
        transpose,
        snapshot=False,
        new_step=False,
        column_sums=False,
        op="identity",
        aux=None,
        config=config,
    )
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
    column_sums: bool = False,
    op: str = "identity",
    aux: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
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
        column_sums: Also return the column sums (a bias gradient), accumulated in float32
            in the same pass and returned as ``Tensor.sum`` would: in ``x_2d``'s dtype for
            ``op="identity"``, float32 for a computed value.
        op: What is cast, computed in float32 in the same pass: ``"identity"`` (``x_2d``),
            ``"gelu"`` (``gelu(x_2d)``, tanh approximation) or ``"dgelu"`` (``x_2d *
            gelu'(aux)``). Amax, transpose and column sums are of that value.
        aux: For ``"dgelu"``: the activation's input, shaped like ``x_2d``, contiguous.
            ``op`` and ``aux`` are checked by the caller,
            :func:`fp8state._runtime.slot_cast.cast_slot`.

    Returns:
        ``(x_fp8, x_fp8_t or None, scale_inv_snapshot, column sums or None)``; the snapshot
        is a 1-element copy of ``scale_inv[slot]`` as it was when the cast ran.
    """
    return _launch(
        x_2d,
        scale,
        scale_inv,
        history,
        slot,
        history.shape[-1],
        fp8_dtype,
        transpose,
        snapshot=True,
        new_step=new_step,
        column_sums=column_sums,
        op=op,
        aux=aux,
    )


_LAUNCHER = FastLauncher(cast_kernel)
_FP8_MAX = {
    dtype: float(torch.finfo(dtype).max) for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
}


def history_blocks(n_slots: int) -> tuple[int, int]:
    """``(SLOTS, CHUNK)`` of a launch's history shift (:mod:`.triton_record`).

    The slots padded to a power of two, and how many rows one chunk of the shift moves (some
    2048 cells at a time).
    """
    slots_block = triton.next_power_of_2(max(n_slots, 2))
    return slots_block, max(1, 2048 // slots_block)


PIPELINE_FROM_BLOCKS = 32  # row blocks per column-sum program from which loads go ahead


def pipeline_stages(column_sums: bool, span: int, block_m: int) -> int | None:
    """The kernel's ``STAGES``: 3 (tiles loaded ahead) for long column walks, else None.

    H200, ``benchmarks/model_casts.py``: walks of 32 row blocks ran 11-12% faster (GELU's
    gradient at 8192x8192 117.4 -> 103.1 us, the 8192x6144 gradient 70.7 -> 62.7), walks of
    8 mixed (2048x8192 GELU's gradient 36.9 -> 35.3, 8192x2048 gradient 26.5 -> 34.3).
    """
    return 3 if column_sums and span // block_m >= PIPELINE_FROM_BLOCKS else None


@functools.lru_cache(maxsize=1024)
def _plan(
    m: int,
    n: int,
    transpose: bool,
    n_slots: int,
    op: str,
    column_sums: bool,
    config: tuple[int, int, int, int] | None,
) -> tuple[Any, ...]:
    """Everything about a launch that depends on shapes only (cached: this runs per cast)."""
    block_m, block_n, warps, split = config or default_config(m, n, transpose, op, column_sums)
    if column_sums:  # each program walks ``span`` rows of one column tile
        span = triton.cdiv(triton.cdiv(m, split), block_m) * block_m
        grid = (triton.cdiv(m, span), triton.cdiv(n, block_n))
    else:  # each program walks ``span`` columns of one row block
        span = triton.cdiv(triton.cdiv(n, split), block_n) * block_n
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, span))
    slots_block, chunk = history_blocks(n_slots)
    stages = pipeline_stages(column_sums, span, block_m)
    ints = (m, n, span, grid[0])  # grid[0]: the casting programs per column range or tile
    specs = (block_m, block_n, warps, slots_block, stages, *map(int_spec, ints))
    return grid, block_m, block_n, warps, span, slots_block, chunk, stages, specs


def _launch(
    x_2d: torch.Tensor,
    scale: torch.Tensor,
    scale_inv: torch.Tensor,
    history: torch.Tensor,
    slot: int,
    n_slots: int,
    fp8_dtype: torch.dtype,
    transpose: bool,
    *,
    snapshot: bool,
    new_step: bool,
    column_sums: bool,
    op: str,
    aux: torch.Tensor | None,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    m, n = x_2d.shape
    device = x_2d.device
    grid, block_m, block_n, warps, span, slots_block, chunk, stages, specs = _plan(
        m, n, transpose, n_slots, op, column_sums, config
    )
    out = torch.empty((m, n), dtype=fp8_dtype, device=device)
    out_t = torch.empty((n, m), dtype=fp8_dtype, device=device) if transpose else out
    inv_out = torch.empty(1, dtype=torch.float32, device=device) if snapshot else scale
    scratch = scratch_pair(history) if new_step else scale
    split_rows = column_sums and grid[0] > 1
    if column_sums:  # as Tensor.sum: the input's dtype, or float32 for a computed value
        sums = torch.empty(
            n, dtype=x_2d.dtype if op == "identity" else torch.float32, device=device
        )
        if split_rows:
            partial, counts = partial_rows(device, grid[0] * n), tile_counts(history, grid[1])
        else:
            partial = counts = sums
    else:
        sums = partial = counts = scale
    rows = history.shape[0] if history.dim() == 2 else 1
    code = OPS[op]
    aux_t = aux if aux is not None else x_2d
    key = (
        specs,
        x_2d.dtype,
        aux_t.dtype,
        fp8_dtype,
        transpose,
        snapshot,
        new_step,
        column_sums,
        split_rows,
        code,
        ptr_aligned(x_2d),
        ptr_aligned(aux_t),
        ptr_aligned(scale),
        ptr_aligned(scale_inv),
        ptr_aligned(history),
        ptr_aligned(sums),
    )
    _LAUNCHER(
        key,
        # One program per row block or column tile share, and one more to shift the history
        # when the launch opens a step (see triton_cast.cast_kernel).
        (grid[0] * grid[1] + new_step,),
        (
            x_2d,
            aux_t,
            out,
            out_t,
            scale,
            scale_inv,
            inv_out,
            history,
            scratch,
            sums,
            partial,
            counts,
            slot,
            n_slots,
            rows,
            m,
            n,
            span,
            grid[0],
            _FP8_MAX[fp8_dtype],
            block_m,
            block_n,
            transpose,
            snapshot,
            new_step,
            column_sums,
            split_rows,
            slots_block,
            chunk,
            code,
            # The explicit clamp only where the conversion alone was found wrong in the
            # transposed copy (see triton_cast): a bf16/fp16 tensor cast as it is, and any
            # cast without the transposed copy (GELU's and its gradient's), go without.
            transpose and (op != "identity" or x_2d.dtype == torch.float32),
            stages,
        ),
        device,
        num_warps=warps,
    )
    return out, (out_t if transpose else None), inv_out, (sums if column_sums else None)
