"""GPU tests start without dead reference cycles: a CUDA graph an earlier test left in one,
freed by the garbage collector while a test captures, would fail that capture."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True)
def _no_dead_graphs() -> None:
    gc.collect()
