"""One-pass FP8 cast on CUDA: amax, quantize and (optionally) the transposed copy together.

Reads the high-precision tensor once and writes the FP8 tensor, its transpose if asked (the
layout FP8 GEMMs need for the other operand of backward), and ``max(|x|)`` over finite
elements into the slot's history cell, so no separate amax or transpose pass runs. The same
launch can also open a new step (shift the history down one row first), copy the slot's
inverse scale for backward, sum the columns (a bias gradient), and cast GELU of the input or
the input times GELU's derivative instead of the input itself (:data:`OPS`).

Casting programs (:func:`fp8state._kernels.cast_launch.default_config`) each take one
``BLOCK_M``-row block and walk a range of its ``BLOCK_N`` column tiles, or, when they sum
columns, one column tile and walk a range of its row blocks; one atomic per program for the
amax. A launch that opens a step has one more program, which only shifts the history
(:mod:`fp8state._kernels.triton_record`).
:mod:`fp8state._kernels.cast_launch` launches it.
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp8state._kernels.triton_record import count_done, record_amax, shift_history
from fp8state.quantize import CAST_OPS

__all__ = ["OPS", "cast_kernel"]


# What the kernel casts: the input itself, GELU (tanh approximation) of it, or the input (an
# incoming gradient) times GELU's derivative at ``aux`` (the activation's input).
OPS = {name: code for code, name in enumerate(CAST_OPS)}
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _sigmoid_2u(u):
    """``sigmoid(2u) = (1 + tanh(u)) / 2``, without tanh's cancellation near -1.

    GELU (tanh form) is ``x * sigmoid(2u)``: written with ``1 + tanh(u)`` it loses all
    relative precision for negative inputs (at x = -3.5 the sum is 3.5e-4), and a hardware
    tanh's absolute error (about 2**-11 * |t|) would be larger than GELU itself there. exp and
    a fast reciprocal keep about 1e-6 relative error everywhere, and 0 and 1 in the limits
    (``1 / inf`` is 0). The exact IEEE division made the cast compute-bound (1.9 TB/s).
    libdevice's fast division is NVIDIA's: the kernel runs on NVIDIA devices only
    (:func:`fp8state._runtime.slot_cast.converts_in_one_rounding`).
    """
    return libdevice.fast_dividef(1.0, 1.0 + tl.exp(-2.0 * u))


@triton.jit
def _apply_op(x, aux_ptr, offsets, mask, OP: tl.constexpr):
    if OP == 1:
        x = x * _sigmoid_2u(_SQRT_2_OVER_PI * (x + _KAPPA * x * x * x))
    elif OP == 2:
        h = tl.load(aux_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        s = _sigmoid_2u(_SQRT_2_OVER_PI * (h + _KAPPA * h * h * h))
        # d/dh [h * sigmoid(2u(h))] = s + 2 h s (1 - s) u'(h)
        slope = s + 2.0 * h * s * (1.0 - s) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _KAPPA * h * h)
        x = x * slope
    return x


@triton.jit
def _cast_tile(
    x_ptr,
    aux_ptr,
    out_ptr,
    out_t_ptr,
    rows,
    cols,
    M,
    N,
    scale,
    fp8_max,
    running,
    TRANSPOSE: tl.constexpr,
    OP: tl.constexpr,
    CLAMP: tl.constexpr,
):
    """Cast one ``rows x cols`` tile (and store its transpose).

    Returns the tile's float32 values (0 where masked out: they add nothing to a sum) and
    ``running``, the elementwise maximum of finite ``|value|`` so far.
    """
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    x = _apply_op(x.to(tl.float32), aux_ptr, offsets, mask, OP)
    ax = tl.abs(x)
    running = tl.maximum(running, tl.where(ax < float("inf"), ax, 0.0))  # drops inf, NaN
    y = x * scale
    # The conversion itself saturates: on the devices this kernel runs on (compute capability
    # 9.0 and up, see fp8state._runtime.slot_cast) Triton converts with cvt.rn.satfinite,
    # which rounds once, takes finite values and infinities past the maximum to it and keeps
    # NaN, as torch.clamp then Tensor.to do. The clamp stays where the launch asks for it
    # (CLAMP): when the tile is also stored transposed, Triton 3.6 redoes the conversion in
    # the transposed layout for float32 inputs and the GELU ops, and gets that copy wrong
    # without it (tests/gpu/test_cast_slot.py checks every op and dtype). A cast without the
    # transposed copy has one layout and never needs it. The select keeps NaN (hardware
    # min/max would bound it).
    if CLAMP:
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -fp8_max), fp8_max))
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, y, mask=mask)
    if TRANSPOSE:
        tl.store(out_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(y), mask=tl.trans(mask))
    return x, running


# How many partial rows of a column tile the last program loads at once: Triton's loop
# unroller (3.2 and later; ``tl.range``'s ``loop_unroll_factor``). Written out by hand
# instead (``tl.static_range``), the unrolled loads took more registers where the launch
# also opens a step (137 against 128, ptxas for sm_90: one program fewer per SM).
UNROLL = tl.constexpr(8 if "loop_unroll_factor" in inspect.signature(tl.range).parameters else 1)


@triton.jit
def _partial_row(partial_ptr, row, N, cols, in_cols):
    """One program's partial column sums, read past L1 (written by another program)."""
    return tl.load(partial_ptr + row * N + cols, mask=in_cols, other=0.0, cache_modifier=".cg")


@triton.jit
def _cast_share(
    pid,
    x_ptr,
    aux_ptr,
    out_ptr,
    out_t_ptr,
    scale_ptr,
    inv_ptr,
    inv_out_ptr,
    sums_ptr,
    partial_ptr,
    count_ptr,
    slot,
    M,
    N,
    span,
    grid_m,
    fp8_max,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    SNAPSHOT: tl.constexpr,
    COLSUM: tl.constexpr,
    SPLIT_ROWS: tl.constexpr,
    OP: tl.constexpr,
    CLAMP: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Casting program ``pid``'s share of the tensor; returns its amax (finite ``|x|``)."""
    # Programs are numbered row block (or row range) first, as a 2-D grid would dispatch them.
    pid_m, pid_n = pid % grid_m, pid // grid_m
    scale = tl.load(scale_ptr + slot)
    if SNAPSHOT:  # the inverse scale as of this cast, for backward (the live one moves on)
        tl.store(inv_out_ptr, tl.load(inv_ptr + slot), mask=pid == 0)
    running = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if COLSUM:
        # Program (pid_m, pid_n): one BLOCK_N column tile, ``span`` rows of it, walked down.
        # The sums stay elementwise in registers and are reduced across rows once at the
        # end: a cross-warp reduction per tile (programs walking along a row) halved the
        # cast's bandwidth.
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        sums = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        first = pid_m * span
        # Long walks load tiles ahead through shared memory (Triton's loop pipelining,
        # STAGES = 3): 11-12% faster from 32 row blocks per program, slower for short walks,
        # which leave it off (None, a plain loop; cast_launch.PIPELINE_FROM_BLOCKS).
        for start in tl.range(first, tl.minimum(first + span, M), BLOCK_M, num_stages=STAGES):
            x, running = _cast_tile(
                x_ptr,
                aux_ptr,
                out_ptr,
                out_t_ptr,
                start + tl.arange(0, BLOCK_M),
                cols,
                M,
                N,
                scale,
                fp8_max,
                running,
                TRANSPOSE,
                OP,
                CLAMP,
            )
            sums += x
        part, in_cols = tl.sum(sums, axis=0), cols < N
        if SPLIT_ROWS:
            # Several programs per column tile: each leaves its partial row and counts itself
            # done (acq_rel: the row is visible to whoever counts last); the last one adds the
            # rows up in row order (bit-reproducible), reading past L1, and resets the tile's
            # counter for the next launch on this history. No reduction launched afterwards.
            # The rows' loads go eight at a time (UNROLL), in flight together: one at a time,
            # each waited for the one before (sequential L2 round trips on the launch's last
            # program). The reset is a plain store: the launch's end orders it before the next
            # launch.
            tl.store(partial_ptr + pid_m * N + cols, part, mask=in_cols)
            if tl.atomic_add(count_ptr + pid_n, 1) == grid_m - 1:
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                if UNROLL > 1:
                    for row in tl.range(0, grid_m, loop_unroll_factor=UNROLL):
                        total += _partial_row(partial_ptr, row, N, cols, in_cols)
                else:
                    for row in range(0, grid_m):
                        total += _partial_row(partial_ptr, row, N, cols, in_cols)
                tl.store(sums_ptr + cols, total.to(sums_ptr.dtype.element_ty), mask=in_cols)
                tl.store(count_ptr + pid_n, 0)
        else:
            tl.store(sums_ptr + cols, part.to(sums_ptr.dtype.element_ty), mask=in_cols)
    else:
        # Program (pid_m, pid_n): BLOCK_M rows, ``span`` columns of them in BLOCK_N tiles.
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        first = pid_n * span
        for start in range(first, tl.minimum(first + span, N), BLOCK_N):
            _, running = _cast_tile(
                x_ptr,
                aux_ptr,
                out_ptr,
                out_t_ptr,
                rows,
                start + tl.arange(0, BLOCK_N),
                M,
                N,
                scale,
                fp8_max,
                running,
                TRANSPOSE,
                OP,
                CLAMP,
            )
    return tl.max(tl.max(running, axis=1), axis=0)


@triton.jit(do_not_specialize=["slot", "n_slots", "hist_rows"])
def cast_kernel(
    x_ptr,
    aux_ptr,
    out_ptr,
    out_t_ptr,
    scale_ptr,
    inv_ptr,
    inv_out_ptr,
    hist_ptr,
    scratch_ptr,
    sums_ptr,
    partial_ptr,
    count_ptr,
    slot,
    n_slots,
    hist_rows,
    M,
    N,
    span,
    grid_m,
    fp8_max,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    SNAPSHOT: tl.constexpr,
    SHIFT: tl.constexpr,
    COLSUM: tl.constexpr,
    SPLIT_ROWS: tl.constexpr,
    SLOTS: tl.constexpr,
    CHUNK: tl.constexpr,
    OP: tl.constexpr,
    CLAMP: tl.constexpr,
    STAGES: tl.constexpr,
):
    # A 1-D grid: the casting programs (``grid_m`` per column range or tile) and, with
    # SHIFT, one more ahead of them. span is a multiple of the block along the program's
    # loop and specialized (Triton then knows each tile starts aligned and vectorizes the
    # loads; unspecialized, the cast ran at 2/3 the speed).
    pid = tl.program_id(0)
    if SHIFT:
        # First record of a step: the history shifts down before row 0 takes this cast's
        # amax. Program 0 only shifts, while the others cast: a casting program that also
        # shifted (before its share, or after it as the last to finish) had the shift on its
        # path, up to 2 us on the shapes timed (docs/benchmarks.md). No casting program
        # reads the history.
        pid = pid - 1
    if pid >= 0:
        amax = _cast_share(
            pid, x_ptr, aux_ptr, out_ptr, out_t_ptr, scale_ptr, inv_ptr, inv_out_ptr,
            sums_ptr, partial_ptr, count_ptr, slot, M, N, span, grid_m, fp8_max, BLOCK_M,
            BLOCK_N, TRANSPOSE, SNAPSHOT, COLSUM, SPLIT_ROWS, OP, CLAMP, STAGES,
        )  # fmt: skip
        record_amax(amax, scratch_ptr, hist_ptr, slot, SHIFT)
    elif SHIFT:
        shift_history(hist_ptr, n_slots, hist_rows, SLOTS, CHUNK)
    if SHIFT:
        count_done(scratch_ptr, hist_ptr, slot, n_slots, SLOTS)
