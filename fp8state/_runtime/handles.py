"""Handles of FP8 modules, for code that can pass only tensors and numbers: custom operators.

A compiled graph calls fp8state's casts as ``torch.library`` operators, whose arguments are
tensors and scalars. The module a cast belongs to travels as its ``id()``, held in a one-element
tensor on the module (``_fp8_handle``): Dynamo makes it an input of the graph, not a constant,
so identical modules share one graph instead of compiling one each. The operator finds the
module here at runtime. Weakly held, and registered where a module is born
(``init_fp8_meta``) or reborn without ``__init__`` (unpickling, ``copy.deepcopy``), so a dead
module's id reused by a new one maps to the new one, and a copy gets a handle of its own.
"""

from __future__ import annotations

import weakref
from typing import Any, cast

import torch

from fp8state._runtime.friend import FP8Friend
from fp8state.errors import ConfigError

__all__ = ["register", "handle_of", "module_of"]

_BY_ID: weakref.WeakValueDictionary[int, FP8Friend] = weakref.WeakValueDictionary()


def register(module: FP8Friend) -> None:
    """Make ``module`` findable by ``id(module)``, and give it its handle tensor."""
    _BY_ID[id(module)] = module
    module.__dict__["_fp8_handle"] = torch.tensor(id(module), dtype=torch.int64)


def handle_of(module: FP8Friend) -> torch.Tensor:
    """The module's handle: a CPU int64 tensor holding its ``id()``."""
    handle: torch.Tensor = cast(Any, module)._fp8_handle
    return handle


def module_of(handle: int | torch.Tensor, what: str) -> FP8Friend:
    """The live FP8 module whose ``id()`` is ``handle``.

    Raises:
        ConfigError: no such module (made without ``init_fp8_meta``, or already collected).
    """
    number = int(handle)
    module = _BY_ID.get(number)
    if module is None:
        raise ConfigError(
            what,
            f"no live FP8 module with handle {number}",
            "the module a compiled graph was traced with, alive until its backward has run",
            "Keep a reference to every module you compile until its backward has run; build "
            "FP8 modules through their constructors (unpickling and copy.deepcopy register "
            "them too; a module made by copying __dict__ must call handles.register).",
        )
    return module
