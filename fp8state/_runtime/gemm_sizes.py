"""The sizes of the GEMMs that ask whether to run in FP8, heard while someone listens.

Every eager FP8 GEMM decides between FP8 and high precision by its multiply-accumulates
(``tokens * in * out``) against its module's threshold. A caller that needs the sizes a step
asks about (the fallback tuner: one candidate threshold per distinct size) listens for the
step's duration; otherwise nothing is kept and the hot path pays one truth test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["LISTENING", "hear", "listening"]

#: The open listeners, innermost last; empty on the hot path.
LISTENING: list[set[int]] = []


def hear(macs: int) -> None:
    """Tell every open listener that a GEMM of ``macs`` multiply-accumulates asked."""
    for heard in LISTENING:
        heard.add(macs)


@contextlib.contextmanager
def listening() -> Iterator[set[int]]:
    """The set of the sizes heard while the block runs (filled as the GEMMs ask)."""
    heard: set[int] = set()
    LISTENING.append(heard)
    try:
        yield heard
    finally:
        LISTENING.remove(heard)
