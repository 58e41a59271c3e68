"""The buffers the cast and norm-cast kernels gather in, kept between launches.

A launch that opens a step gathers its programs' amaxes in an int32 pair; one whose column
sums split the rows adds partial rows and counts each column tile's finished programs
(:mod:`fp8state._kernels.triton_record`, :mod:`fp8state._kernels.triton_cast`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from fp8state._kernels.launch import raw_stream

__all__ = ["partial_rows", "scratch_pair", "tile_counts"]

# The zeroed int32 buffers a launch gathers in (a step-opening launch's pair, a row-split column
# sum's tile counters) are kept per history, by its address. Every launch leaves them zeroed
# for the next, and the launches that record into one history run one after another, on
# whatever stream (the history itself needs that). So a CUDA graph captured after warm-up
# launches finds them made and zeroes nothing at replay. Buffers kept per stream could not go
# into a graph, which replays on any stream, and buffers made during a capture are zeroed by
# a kernel of their own at every replay (160 such kernels in a graphed step of
# benchmarks/transformer.py's model at 2048 tokens, docs/benchmarks.md). Entries stay: a graph
# keeps the addresses it captured, and a history's memory, once freed, passes its zeroed
# buffers on to the next history that takes it.
_PAIRS: dict[int, torch.Tensor] = {}
_COUNTS: dict[tuple[int, int], torch.Tensor] = {}
# Pairs are cut from zeroed slabs (one allocation and one zeroing per this many), each padded
# to 16 bytes: Triton specializes pointers on 16-byte alignment, and the launch key assumes it.
# A history first seen while a graph is captured gets a pair of its own (_cut_pair).
_SLAB_PAIRS = 1024
_PAIR_INTS = 4
_SLABS: dict[torch.device, tuple[torch.Tensor, int]] = {}
# Held while a history's buffers are made (its first launches only): two threads making pairs
# at once must not cut the same one from a slab.
_MAKING = threading.Lock()


def _stream_key(device: torch.device) -> tuple[int, int]:
    """``(device index, current stream)``: launches under one key run one after another."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, raw_stream(index)


def _kept(
    table: dict[Any, torch.Tensor], key: object, make: Callable[..., torch.Tensor], *args: object
) -> torch.Tensor:
    """``table[key]``, made by ``make(*args)`` the first time (under the lock)."""
    found = table.get(key)
    if found is None:
        with _MAKING:
            found = table.get(key)
            if found is None:
                found = table[key] = make(*args)
    return found


def scratch_pair(history: torch.Tensor) -> torch.Tensor:
    """The zeroed int32 (amax bits, programs done) pair ``history``'s opening launches use."""
    return _kept(_PAIRS, history.data_ptr(), _cut_pair, history.device)


def _cut_pair(device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # A pair made under capture is zeroed by the graph at every replay: a pair of its
        # own, as a slab made there would be zeroed whole, under other histories' launches.
        return _zeroed(_PAIR_INTS, device)
    slab, used = _SLABS.get(device, (None, _SLAB_PAIRS))
    if slab is None or used == _SLAB_PAIRS:  # the first pair on this device, or slab full
        slab = torch.zeros(_SLAB_PAIRS, _PAIR_INTS, dtype=torch.int32, device=device)
        used = 0
    _SLABS[device] = slab, used + 1
    return slab[used]


def tile_counts(history: torch.Tensor, tiles: int) -> torch.Tensor:
    """The zeroed int32 counters, one per column tile, of a row-split column sum."""
    key = (history.data_ptr(), tiles)
    return _kept(_COUNTS, key, _zeroed, tiles, history.device)


def _zeroed(ints: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(ints, dtype=torch.int32, device=device)


# Per device and stream: float32 room for the column sums' partial rows, written before they
# are read in each launch. A launch being captured into a CUDA graph gets its own instead
# (allocated, not zeroed): replays keep the addresses they captured.
_PARTIALS: dict[tuple[int, int], torch.Tensor] = {}


def partial_rows(device: torch.device, floats: int) -> torch.Tensor:
    """At least ``floats`` float32 for a row-split column sum's partial rows (not zeroed)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(floats, dtype=torch.float32, device=device)
    key = _stream_key(device)
    partial = _PARTIALS.get(key)
    if partial is None or partial.numel() < floats:
        partial = _PARTIALS[key] = torch.empty(floats, dtype=torch.float32, device=device)
    return partial
