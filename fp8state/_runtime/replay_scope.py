"""The scopes of ``fp8state.functional.activation_checkpoint``: replays exact in every case.

The drop-in runs the checkpointed function inside a :class:`Scope` of its own. The first run
(the forward) records every FP8 call into it, in order, per module and call site; every later
run (a recomputation, once per backward, again with ``retain_graph=True``) replays the same
calls from it in the same order. The match is by construction, so it holds whatever else runs
between the forward and its backward: other micro-batches, pipeline stages, scale updates.

Scopes nest (a checkpoint inside a checkpointed function): a call replays from the innermost
scope that is replaying, and is recorded into every scope inside that one that is recording
(an inner checkpoint's first run during the outer one's recomputation).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from fp8state._runtime.forward_record import ForwardRecord, site_name
from fp8state.errors import RecomputationError

__all__ = ["Scope", "running", "innermost_replay", "recording", "any_replay"]


class Scope:
    """The FP8 forward records of one checkpointed call, per (module, call site), in order."""

    def __init__(self) -> None:
        self.records: dict[tuple[object, int], list[ForwardRecord]] = {}
        self.recorded = False  # the forward has run: later runs are recomputations


class _Frame:
    """One run of a scope's function on this thread's stack."""

    __slots__ = ("scope", "replay", "counts")

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.replay = scope.recorded
        self.counts: dict[tuple[object, int], int] = {}

    def append(self, module: object, site: int, record: ForwardRecord) -> None:
        self.scope.records.setdefault((module, site), []).append(record)

    def take(self, module: object, site: int) -> ForwardRecord:
        """The record of this call's forward: the same call, counted in order.

        Raises:
            RecomputationError: the recomputation runs the call more often than the forward.
        """
        key = (module, site)
        index = self.counts.get(key, 0)
        records = self.scope.records.get(key, ())
        if index >= len(records):
            raise RecomputationError(
                site_name(module, site),
                f"call {index + 1} of the module in a recomputation whose forward made "
                f"{len(records)}",
                "a checkpointed function that runs the same calls each time",
                "Make the checkpointed function deterministic: the same modules in the same "
                "order, whatever the step (no branching on data or on training state).",
            )
        self.counts[key] = index + 1
        return records[index]


class _Stack(threading.local):
    def __init__(self) -> None:
        self.frames: list[_Frame] = []


_STACK = _Stack()


@contextmanager
def running(scope: Scope) -> Iterator[None]:
    """Run the body as ``scope``'s forward the first time, as its recomputation afterwards."""
    frame = _Frame(scope)
    _STACK.frames.append(frame)
    try:
        yield
    finally:
        _STACK.frames.pop()
        scope.recorded = True


def any_replay() -> bool:
    """Whether a scope on this thread is replaying."""
    frames = _STACK.frames
    return bool(frames) and any(f.replay for f in frames)  # the hot path: no frames


def innermost_replay() -> _Frame | None:
    """The innermost replaying scope's frame on this thread, if any."""
    for frame in reversed(_STACK.frames):
        if frame.replay:
            return frame
    return None


def recording() -> list[_Frame]:
    """The recording frames inside the innermost replaying one (all of them if none)."""
    frames = _STACK.frames
    if not frames:  # the hot path: no drop-in checkpoint runs
        return []
    inner: list[_Frame] = []
    for frame in reversed(frames):
        if frame.replay:
            break
        inner.append(frame)
    return inner
