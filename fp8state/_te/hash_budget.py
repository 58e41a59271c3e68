"""A bound on the hashing a pickle can make its reader do: no hash bombs.

Python does not cache the hash of a tuple. A pickle of a few hundred bytes can build a tuple
that holds the same tuple twice, that one the next, and so on 48 deep (the memo shares them):
hashing it, as a dict key or a set element, visits 2**48 leaves. Keys of a few thousand
elements referenced a million times through the memo cost as much. Before the unpickler
hashes anything it charges the key here: each key's elements are counted, without a memo,
against one budget per load, and a key whose hash is not known to be cheap is refused. The
budget grows with the file (:func:`budget_for`): what a valid pickle hashes is proportional
to its size (a DCP checkpoint's metadata hashes about one element per eight bytes). Pickles
read while another load runs (nested storage blobs, each as often as the outer pickle names
it) draw on that load's budget (:func:`sharing`), not on fresh ones.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import io
import os
from collections.abc import Iterable, Iterator
from typing import IO

import torch

from fp8state.errors import LegacyFormatError

__all__ = ["BASE_HASHED_ELEMENTS", "EXPECTED", "HashBudget", "budget_for", "sharing"]

#: How many elements any load may hash, plus one per byte of the pickle read.
BASE_HASHED_ELEMENTS = 1 << 20

# Hashes that cost one step: cached (str, bytes), constant size, or the object's identity.
_ATOMS = frozenset({str, bytes, bool, float, complex, type(None), torch.dtype, torch.layout})
_ATOMS |= {torch.device, torch.memory_format}


#: What a refusal of this module says was expected (callers tell it from other refusals).
EXPECTED = "dict keys and set elements of strings, numbers, small tuples or objects"

_shared: contextvars.ContextVar[HashBudget | None] = contextvars.ContextVar(
    "fp8state_hash_budget", default=None
)


def _refused(what: str) -> LegacyFormatError:
    return LegacyFormatError(
        "",
        what,
        EXPECTED,
        "The checkpoint is corrupt or was crafted; nothing was executed. Do not read it with "
        "a trusting reader either: plain pickle and torch.load hash the same keys.",
    )


class HashBudget:
    """Counts what one load hashes; refuses keys past ``limit`` elements in all.

    Args:
        limit: Elements the load may hash in all.

    Example:
        >>> budget = HashBudget(limit=8)
        >>> budget.charge(("a", 1))
        >>> budget.left
        5
    """

    def __init__(self, limit: int = BASE_HASHED_ELEMENTS) -> None:
        self.limit = limit
        self.left = limit

    def _spent(self) -> LegacyFormatError:
        limit = f"{self.limit:,}"
        return _refused(f"dict keys and set elements whose hashing visits over {limit} elements")

    def charge_items(self, items: object, pairs: bool) -> None:
        """Charge what ``set(items)`` (``pairs=False``) or ``OrderedDict(items)`` hashes.

        Args:
            items: The call's first argument.
            pairs: Whether ``items`` holds ``(key, value)`` pairs (a mapping's are its keys).
        """
        if isinstance(items, (str, bytes, bytearray)):
            self.left -= len(items)  # one character or byte per element, hashed at once
            if self.left < 0:
                raise self._spent()
            return
        if not isinstance(items, (list, tuple, dict, set, frozenset)):
            raise _refused(f"a call hashing the items of a {type(items).__name__}")
        pairs = pairs and not isinstance(items, dict)
        self.charge_all(
            item[0] if pairs and isinstance(item, (tuple, list)) and item else item
            for item in items
        )

    def charge_all(self, keys: Iterable[object]) -> None:
        """:meth:`charge` each of ``keys``; strings (most keys) without a call each."""
        for key in keys:
            if type(key) is str:  # its hash is cached: one step
                self.left -= 1
            else:
                self.charge(key)
        if self.left < 0:
            raise self._spent()

    def charge(self, key: object) -> None:
        """Count the elements hashing ``key`` visits, tuples inside tuples once per path.

        Raises:
            LegacyFormatError: the budget is spent, or ``key`` is of a type whose hash is
                not known to be cheap.
        """
        stack = [key]
        while stack:
            obj = stack.pop()
            self.left -= 1
            if self.left < 0:
                raise self._spent()
            kind = type(obj)
            if kind in _ATOMS:
                continue
            if isinstance(obj, int):  # hashing an int reads each of its digits
                self.left -= obj.bit_length() >> 6
            elif isinstance(obj, (tuple, frozenset)):  # torch.Size and named tuples too
                if len(obj) > self.left:
                    raise self._spent()
                stack.extend(obj)
            elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
                # A generated __hash__ hashes the fields (in the instance dict, or in slots).
                held = getattr(obj, "__dict__", None)
                if held is None:
                    stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
                else:
                    stack.extend(held.values())
            elif isinstance(obj, (torch.Tensor, enum.Enum)) or kind.__hash__ is object.__hash__:
                continue  # identity, or an enum member's name
            else:
                raise _refused(f"a dict key or set element of type {kind.__name__}")


@contextlib.contextmanager
def sharing(budget: HashBudget) -> Iterator[None]:
    """Inside the ``with`` block, :func:`budget_for` returns ``budget`` (nested loads)."""
    token = _shared.set(budget)
    try:
        yield
    finally:
        _shared.reset(token)


def budget_for(file: IO[bytes]) -> HashBudget:
    """The budget of a load from ``file``.

    The running load's, if one shares its budget (:func:`sharing`); else
    :data:`BASE_HASHED_ELEMENTS` plus the file's size in bytes.
    """
    shared = _shared.get()
    if shared is not None:
        return shared
    size = 0
    if isinstance(file, io.BytesIO):
        with file.getbuffer() as view:  # released at once: the file stays resizable
            size = view.nbytes
    else:
        try:
            size = os.fstat(file.fileno()).st_size
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            pass  # a stream of unknown size: the base budget
    return HashBudget(BASE_HASHED_ELEMENTS + size)
