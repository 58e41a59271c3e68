"""Many problems, one error: how the checkpoint helpers report everything wrong at once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fp8state.errors import CheckpointError, FP8StateError

#: At most this many problems are spelled out in a message (all stay in ``problems``).
_SHOWN = 20


class StateDictError(CheckpointError):
    """A state dict does not fit a model; nothing was loaded.

    Attributes:
        problems: One :class:`~fp8state.errors.FP8StateError` per key at fault, each naming
            the key, what was found, what was expected and the fix.
    """

    def __init__(
        self,
        key: str,
        found: str,
        expected: str,
        fix: str,
        problems: Sequence[FP8StateError] = (),
    ) -> None:
        super().__init__(key, found, expected, fix)
        self.problems = tuple(problems)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.found, self.expected, self.fix, self.problems))


def summarize(problems: Sequence[FP8StateError]) -> str:
    """One indented line per problem (the first :data:`_SHOWN`), for an error's ``found``."""
    lines = [f"{len(problems)} problem(s):"]
    lines += [f"  - {p}" for p in problems[:_SHOWN]]
    if len(problems) > _SHOWN:
        lines.append(f"  ... and {len(problems) - _SHOWN} more (see the error's .problems)")
    return "\n".join(lines)


def keys_of(problems: Sequence[FP8StateError], limit: int = 5) -> str:
    """The problems' keys, comma-separated, for an error's ``key``."""
    keys = list(dict.fromkeys(p.key for p in problems))
    shown = ", ".join(keys[:limit])
    return shown if len(keys) <= limit else f"{shown}, ... ({len(keys)} keys)"
