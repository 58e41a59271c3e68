"""The zeroed buffers the cast kernels gather in stay with their history, one set per history."""

from __future__ import annotations

import torch

from fp8state._kernels import scratch


def test_a_history_keeps_one_zeroed_aligned_pair() -> None:
    history = torch.rand(8, 3)
    pair = scratch.scratch_pair(history)
    assert pair.dtype == torch.int32 and pair.numel() >= 2
    assert not pair.any()
    assert pair.data_ptr() % 16 == 0  # the launch key assumes Triton's pointer alignment
    assert scratch.scratch_pair(history) is pair
    # The same memory seen through another tensor (a graph's or a compiled caller's alias)
    # is the same history.
    assert scratch.scratch_pair(history.view(8, 3)) is pair


def test_histories_share_no_pair() -> None:
    histories = [torch.rand(4, 2) for _ in range(scratch._SLAB_PAIRS + 2)]
    pairs = [scratch.scratch_pair(h) for h in histories]
    cells = {p.data_ptr() for p in pairs}
    assert len(cells) == len(histories)
    # Every pair in its own 16 bytes, whichever slab it was cut from.
    ends = sorted(cells)
    assert all(b - a >= 16 for a, b in zip(ends, ends[1:], strict=False))
    assert all(not p.any() and p.data_ptr() % 16 == 0 for p in pairs)


def test_tile_counters_are_kept_per_history_and_tile_count() -> None:
    history, other = torch.rand(8, 3), torch.rand(8, 3)
    counts = scratch.tile_counts(history, 6)
    assert counts.dtype == torch.int32 and counts.shape == (6,) and not counts.any()
    assert scratch.tile_counts(history, 6) is counts
    assert scratch.tile_counts(history, 7) is not counts
    assert scratch.tile_counts(other, 6).data_ptr() != counts.data_ptr()
