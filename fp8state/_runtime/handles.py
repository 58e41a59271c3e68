"""Integer handles of FP8 modules, for code that can pass only numbers: custom operators.

A compiled graph calls fp8state's casts as ``torch.library`` operators, whose arguments are
tensors and scalars. The module a cast belongs to travels as its ``id()``; the operator finds
it here at runtime. Weakly held, and registered where a module is born (``init_fp8_meta``) or
reborn without ``__init__`` (unpickling, ``copy.deepcopy``), so a dead module's id reused by a
new one maps to the new one.
"""

from __future__ import annotations

import weakref

from fp8state._runtime.friend import FP8Friend
from fp8state.errors import ConfigError

__all__ = ["register", "module_of"]

_BY_ID: weakref.WeakValueDictionary[int, FP8Friend] = weakref.WeakValueDictionary()


def register(module: FP8Friend) -> None:
    """Make ``module`` findable by ``id(module)``."""
    _BY_ID[id(module)] = module


def module_of(handle: int, what: str) -> FP8Friend:
    """The live FP8 module whose ``id()`` is ``handle``.

    Raises:
        ConfigError: no such module (made without ``init_fp8_meta``, or already collected).
    """
    module = _BY_ID.get(handle)
    if module is None:
        raise ConfigError(
            what,
            f"no live FP8 module with handle {handle}",
            "the module a compiled graph was traced with, alive until its backward has run",
            "Keep a reference to every module you compile until its backward has run; build "
            "FP8 modules through their constructors (unpickling and copy.deepcopy register "
            "them too; a module made by copying __dict__ must call handles.register).",
        )
    return module
