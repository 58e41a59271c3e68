"""How a value read from a file is shown in an error: bounded, on one line, in ASCII.

``repr`` of a crafted value can be as costly as hashing it: a tuple that holds the same tuple
twice, 40 deep, prints 2**40 leaves. :func:`shown` prints at most a few levels and a few items
of each container, and any other object by its type name alone (its own ``__repr__`` might
walk everything), then cuts the text to a length.
"""

from __future__ import annotations

import reprlib

__all__ = ["shown"]


class _Bounded(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = 6
        self.maxset = self.maxfrozenset = self.maxdeque = 6
        self.maxstring = self.maxlong = self.maxother = 80

    def repr_instance(self, x: object, level: int) -> str:
        if isinstance(x, (float, complex, bool, type(None), bytes, bytearray)):
            return reprlib.Repr.repr_instance(self, x, level)  # flat: bounded by maxother
        return f"<{type(x).__name__}>"


_BOUNDED = _Bounded()


def shown(value: object, limit: int = 120) -> str:
    """``value`` for an error message: bounded work, one line, ASCII, at most ``limit`` chars.

    Example:
        >>> from fp8state._shown import shown
        >>> shown(("a", [1, 2, 3, 4, 5, 6, 7, 8]))
        "('a', [1, 2, 3, 4, 5, 6, ...])"
        >>> shown(object())
        '<object>'
    """
    text = _BOUNDED.repr(value).encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
