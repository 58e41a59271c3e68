"""A process-wide count of FP8 buffer replacements, for caches of buffer addresses.

The batched kernels (scale update, staging gather) keep device-side tables of buffer
addresses across steps. Any replacement of a module's FP8 buffer tensors (``.to()``, history
growth, a load onto a meta module, a new module that may reuse a dead one's ``id()``) bumps the
count, and a table built under another count is rebuilt.
"""

from __future__ import annotations

__all__ = ["buffer_generation", "bump_buffer_generation"]

_COUNT = [0]


def buffer_generation() -> int:
    """The current count (only ever increases)."""
    return _COUNT[0]


def bump_buffer_generation() -> None:
    """Record that some module's FP8 buffers may be new tensors."""
    _COUNT[0] += 1
