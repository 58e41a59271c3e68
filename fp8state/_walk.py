"""One walker for nested containers read from files: each container once, iteratively, bounded.

A pickle can make a list that holds the same list twice, that one the next, and so on 48
deep: 2**48 paths through a few hundred bytes (the pickle memo shares objects). Recursing
walkers never finish; 100000 nested lists overflow Python's stack. Every walk over decoded
data goes through :func:`walk`: each container's contents are visited once however often it
is referenced, without recursion, and nesting deeper than :data:`MAX_DEPTH` is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fp8state.errors import LegacyFormatError

__all__ = ["MAX_DEPTH", "walk", "containers"]

#: How deep containers may nest in anything fp8state walks (checkpoints nest a few levels).
MAX_DEPTH = 256

Path = tuple[Any, ...]


def containers(_path: Path, value: object) -> bool:
    """The default: descend into mappings, lists and tuples."""
    return isinstance(value, (Mapping, list, tuple))


def walk(
    obj: object, descend: Callable[[Path, object], bool] = containers
) -> Iterator[tuple[Path, object]]:
    """``(path, value)`` for ``obj`` and everything inside it, in order (depth first).

    Args:
        obj: The root.
        descend: Whether to visit the items of the container ``value`` found at ``path``;
            only mappings, lists and tuples are ever descended into.

    Raises:
        LegacyFormatError: containers nested deeper than :data:`MAX_DEPTH`.

    Example:
        >>> shared = [1]
        >>> [path for path, _ in walk({"a": shared, "b": shared})]
        [(), ('a',), ('a', 0), ('b',)]
    """
    seen: set[int] = set()
    stack: list[tuple[Path, object]] = [((), obj)]
    while stack:
        path, value = stack.pop()
        yield path, value
        if not isinstance(value, (Mapping, list, tuple)) or not descend(path, value):
            continue
        if id(value) in seen:  # visited already: a reference the memo shares
            continue
        seen.add(id(value))
        if len(path) >= MAX_DEPTH:
            raise LegacyFormatError(
                "",
                f"containers nested more than {MAX_DEPTH} deep",
                f"at most {MAX_DEPTH} levels of dicts, lists and tuples",
                "The checkpoint is corrupt or was crafted.",
            )
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        stack.extend(((*path, key), item) for key, item in reversed(list(items)))
