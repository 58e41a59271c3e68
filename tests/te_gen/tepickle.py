"""Pickling helpers that write what TE wrote, without TE: TE class names and cuda:N storages.

* :class:`TEPickler` pickles generator classes registered with :func:`te_name` under TE's own
  names (``transformer_engine.common.recipe.DelayedScaling``), as a TE run would.
* :func:`saved_on` makes ``torch.save`` / ``pickle`` record chosen storages with a location tag
  such as ``"cuda:0"`` (through torch's public ``register_package``), so files look as if their
  tensors lived on a GPU.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_NAMES: dict[Any, tuple[str, str]] = {}
_TAGGED: dict[int, str] = {}
_REGISTERED = False


def te_name(module: str, name: str) -> Any:
    """Class/function decorator: pickle the object as ``module.name``."""

    def register(obj: Any) -> Any:
        _NAMES[obj] = (module, name)
        return obj

    return register


class TEPickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    """Pure-Python pickler that writes registered objects by their TE name (no import check)."""

    # Functions go through the dispatch table straight to the base save_global; route them here.
    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]
    dispatch[types.FunctionType] = lambda self, obj: self.save_global(obj)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        try:
            module, qualname = _NAMES[obj]
        except (KeyError, TypeError):
            return super().save_global(obj, name)
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


def te_dumps(obj: Any, protocol: int = 4) -> bytes:
    """``pickle.dumps`` as TE called it (Python's default protocol 4), TE names resolved."""
    buf = io.BytesIO()
    TEPickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


def as_uint8(data: bytes) -> torch.Tensor:
    """TE's wrapping of pickle bytes: a 1-D CPU uint8 tensor."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def _tagger(storage: Any) -> str | None:
    return _TAGGED.get(storage.data_ptr()) if storage.nbytes() else None


def _never(storage: Any, location: str) -> None:
    return None


@contextlib.contextmanager
def saved_on(location: str, tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Inside the block, the storages of ``tensors`` are saved with ``location`` as their tag."""
    global _REGISTERED
    if not _REGISTERED:
        # Priority below torch's CPU tagger (10): ours answers first for tagged storages only.
        torch.serialization.register_package(1, _tagger, _never)
        _REGISTERED = True
    ptrs = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    _TAGGED.update(dict.fromkeys(ptrs, location))
    try:
        yield
    finally:
        for ptr in ptrs:
            _TAGGED.pop(ptr, None)
