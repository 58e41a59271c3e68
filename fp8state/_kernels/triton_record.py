"""How a casting launch records its amax in a slot's history, opening a step when asked.

Shared by every kernel that casts into a slot (:mod:`fp8state._kernels.triton_cast`,
:mod:`fp8state._kernels.triton_norm_cast`). A launch that records the first amax of a step
(``SHIFT``) has one more program than it casts with: that program only shifts the history
down (:func:`shift_history`), the casting ones gather their amaxes in a scratch pair
(:func:`record_amax`), and whichever program finishes last writes row 0 (:func:`count_done`).
A launch within a step max-combines straight into row 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["count_done", "record_amax", "shift_history"]


@triton.jit
def shift_history(hist_ptr, n_slots, hist_rows, SLOTS: tl.constexpr, CHUNK: tl.constexpr):
    """Shift the history down one row (row 0 stays as it was, until the step's amax is known).

    Run by one program only, while the others cast: no program reads the history. Chunks go
    from the bottom up so that each row is read before the chunk below overwrites it; the
    barriers order each chunk's loads before its stores across the program's threads.
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


@triton.jit
def record_amax(amax, scratch_ptr, hist_ptr, slot, SHIFT: tl.constexpr):
    """One casting program's amax: into scratch when the launch opens a step, else row 0."""
    if SHIFT:
        # Into scratch as int bits (same order as the floats, all >= 0); the last program
        # to count itself done writes row 0 from it. Relaxed: the same thread (Triton's
        # thread 0, after a barrier) counts itself done next, with acq_rel, and that release
        # orders this maximum before the last program's read (the PTX for sm_90: `python
        # benchmarks/cast_ptx.py --order`). The default fenced here too, a second wait for
        # the program's stores.
        tl.atomic_max(scratch_ptr, amax.to(tl.int32, bitcast=True), sem="relaxed")
    else:
        # Relaxed: nothing in this launch reads row 0, and the launch's end orders it before
        # any later reader. The default (acq_rel) fences every program's end behind its
        # stores: 0.55-1.15 us more per cast at 2048 tokens on an H100 (6.2-6.5 against
        # 5.3-5.5 us at 2048x2048, benchmarks/model_casts.py).
        tl.atomic_max(hist_ptr + slot, amax, sem="relaxed")


@triton.jit
def count_done(scratch_ptr, hist_ptr, slot, n_slots, SLOTS: tl.constexpr):
    """Count this program done; the last one writes the step's row 0 and resets scratch.

    acq_rel: whatever a program stored before counting (the shift, its amax) is visible to
    whoever counts last, which then reads the maximum with a plain load past L1. Scratch is
    left zeroed for the next launch on this history by plain stores, which the launch's end
    orders before that launch (exchanges were two more fenced round trips on the launch's
    last program).
    """
    if tl.atomic_add(scratch_ptr + 1, 1) == tl.num_programs(0) - 1:
        total = tl.load(scratch_ptr, cache_modifier=".cg").to(tl.float32, bitcast=True)
        tl.store(scratch_ptr + tl.arange(0, 2), tl.zeros((2,), dtype=tl.int32))
        row0 = tl.arange(0, SLOTS)
        tl.store(hist_ptr + row0, tl.where(row0 == slot, total, 0.0), mask=row0 < n_slots)
