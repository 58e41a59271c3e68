"""Which micro-batch a forward belongs to, for calls that do not say it themselves.

An FP8 module's forward takes TransformerEngine's ``is_first_microbatch``: True casts the
weight and keeps the FP8 copy, False reuses it. ``make_graphed_callables(...,
fp8_weight_caching=True)`` captures the callables it is given, which call their FP8 modules
however they like, usually without that argument. While it warms up and captures one kind of
micro-batch, :func:`assumed` makes every FP8 weight cast of this thread that was not given
the argument behave as if it had been, so a graph records that kind's work.

``fp8state.cast_weights_ahead`` casts chosen modules' weights before a step's forwards and
has those modules' calls reuse them in the same way (:class:`Ahead`, :func:`reuses_ahead`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from fp8state.errors import ConfigError

__all__ = ["Ahead", "ahead", "assumed", "casting_ahead", "first_microbatch", "reuses_ahead"]


class Ahead:
    """The weights a ``cast_weights_ahead`` block cast, and those no FP8 call has taken yet.

    Keys are ``(id(module), gemm)``; ``waiting``'s values name the module for an error.
    """

    __slots__ = ("cast", "waiting")

    def __init__(self) -> None:
        self.cast: set[tuple[int, int]] = set()
        self.waiting: dict[tuple[int, int], str] = {}

    def add(self, module: object, gemm: int, name: str) -> None:
        """Note that GEMM ``gemm`` of ``module`` (called ``name``) was cast ahead."""
        self.cast.add((id(module), gemm))
        self.waiting[(id(module), gemm)] = name


class _State(threading.local):
    flag: bool | None = None
    ahead: Ahead | None = None


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


def casting_ahead() -> bool:
    """Whether a ``cast_weights_ahead`` block is open on this thread."""
    return _STATE.ahead is not None


def reuses_ahead(module: object, gemm: int) -> bool:
    """Whether the call multiplies with the copy a block cast ahead (it is then taken)."""
    block = _STATE.ahead
    if block is None:  # the hot path outside any block: one attribute read
        return False
    key = (id(module), gemm)
    if key not in block.cast:
        return False
    block.waiting.pop(key, None)
    return True


@contextmanager
def ahead(block: Ahead) -> Iterator[Ahead]:
    """Inside, the weights ``block`` notes are reused by their modules' calls; one at a time."""
    if _STATE.ahead is not None:
        raise ConfigError(
            "cast_weights_ahead",
            "a block inside another",
            "one block around a step's forwards",
            "Enter it once, around all the modules it should cast.",
        )
    _STATE.ahead = block
    try:
        yield block
    finally:
        _STATE.ahead = None
