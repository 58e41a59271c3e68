"""Capture pauses Python's cyclic garbage collector (a graph it frees mid-capture fails the
capture), after collecting what is already dead; the collector's setting comes back after.
The captures themselves run in tests/gpu/test_make_graphed_callables.py."""

from __future__ import annotations

import gc
import weakref

import pytest

from fp8state.graphs._capture import _collector_paused


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_dead_cycles_are_collected_then_the_collector_waits() -> None:
    dead = weakref.ref(_Node())
    assert dead() is not None  # a cycle outlives its last reference
    with _collector_paused():
        assert dead() is None
        assert not gc.isenabled()
        later = weakref.ref(_Node())
        gc_thresholds = gc.get_threshold()
        for _ in range(10 * gc_thresholds[0]):  # allocations that would trigger collections
            _ = [[]]
        assert later() is not None
    assert gc.isenabled()


def test_an_error_inside_still_restores_the_collector() -> None:
    with pytest.raises(RuntimeError, match="inside"), _collector_paused():
        raise RuntimeError("inside")
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled() -> None:
    gc.disable()
    try:
        with _collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
