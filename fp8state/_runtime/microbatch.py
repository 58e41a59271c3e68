"""Which micro-batch a forward belongs to, for calls that do not say it themselves.

An FP8 module's forward takes TransformerEngine's ``is_first_microbatch``: True casts the
weight and keeps the FP8 copy, False reuses it. ``make_graphed_callables(...,
fp8_weight_caching=True)`` captures the callables it is given, which call their FP8 modules
however they like, usually without that argument. While it warms up and captures one kind of
micro-batch, :func:`assumed` makes every FP8 weight cast of this thread that was not given
the argument behave as if it had been, so a graph records that kind's work.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["assumed", "first_microbatch"]


class _State(threading.local):
    flag: bool | None = None


_STATE = _State()


def first_microbatch(given: bool | None) -> bool | None:
    """``given`` if set, else the flag :func:`assumed` put in force on this thread (or None)."""
    return given if given is not None else _STATE.flag


@contextmanager
def assumed(flag: bool | None) -> Iterator[None]:
    """Inside, calls without ``is_first_microbatch`` run as if given ``flag`` (None: as usual)."""
    before = _STATE.flag
    _STATE.flag = flag
    try:
        yield
    finally:
        _STATE.flag = before
