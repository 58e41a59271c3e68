"""What a model's state dict holds, found by walking the modules (no ``state_dict()`` call).

Validation needs the model's keys, shapes and FP8 modules without running ``get_extra_state``
(which copies every module's metadata to the host). It also needs the canonical names that
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` uses, which drop wrapper
segments: DDP's ``module.``, ``torch.compile``'s ``_orig_mod.`` and activation checkpointing's
``_checkpoint_wrapped_module.``. A state dict may use either spelling;
:meth:`KeyResolver.resolve` maps both to the model's own key.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from fp8state._walk import walk
from fp8state.mixin import FP8StateMixin
from fp8state.schema import EXTRA_STATE_KEY, is_extra_state_key

_CHECKPOINT_WRAPPER_SEGMENT = "_checkpoint_wrapped_module"


@dataclass(frozen=True)
class Entry:
    """One key of a model's state dict.

    Attributes:
        key: The key ``model.state_dict()`` uses (``"module.blocks.0.weight"`` under DDP).
        canonical: The key ``get_model_state_dict(model)`` uses (``"blocks.0.weight"``).
        kind: ``"param"``, ``"buffer"`` or ``"extra"`` (an ``_extra_state``).
        module: The module that owns the entry.
        name: The attribute name inside ``module`` (``"_extra_state"`` for extra state).
    """

    key: str
    canonical: str
    kind: Literal["param", "buffer", "extra"]
    module: nn.Module
    name: str

    def tensor(self) -> torch.Tensor | None:
        """The live parameter or buffer (None for extra state)."""
        if self.kind == "param":
            return self.module._parameters[self.name]
        if self.kind == "buffer":
            return self.module._buffers[self.name]
        return None


def _is_wrapper_segment(parent: nn.Module, segment: str) -> bool:
    # Segments get_model_state_dict drops (torch.distributed.checkpoint.state_dict._get_fqns).
    if segment == _CHECKPOINT_WRAPPER_SEGMENT:
        return True
    if segment == "module" and isinstance(parent, nn.parallel.DistributedDataParallel):
        return True
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized_cls = getattr(optimized, "OptimizedModule", None)
    return (
        segment == "_orig_mod" and optimized_cls is not None and isinstance(parent, optimized_cls)
    )


def walk_modules(
    module: nn.Module, prefix: str, canonical: str
) -> Iterator[tuple[str, str, nn.Module]]:
    # Same recursion as nn.Module.state_dict: every child, shared ones once per path.
    yield prefix, canonical, module
    for name, child in module._modules.items():
        if child is None:
            continue
        child_canonical = (
            canonical if _is_wrapper_segment(module, name) else (f"{canonical}{name}.")
        )
        yield from walk_modules(child, f"{prefix}{name}.", child_canonical)


def _has_extra_state(module: nn.Module) -> bool:
    # nn.Module._load_from_state_dict expects an _extra_state exactly when this is overridden.
    return type(module).set_extra_state is not nn.Module.set_extra_state


def model_entries(model: nn.Module) -> list[Entry]:
    """Every key ``model.load_state_dict`` expects, in ``state_dict()`` order."""
    entries: list[Entry] = []
    for prefix, canonical, module in walk_modules(model, "", ""):
        for name, param in module._parameters.items():
            if param is not None:
                entries.append(Entry(prefix + name, canonical + name, "param", module, name))
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                entries.append(Entry(prefix + name, canonical + name, "buffer", module, name))
        if _has_extra_state(module):
            entries.append(
                Entry(
                    prefix + EXTRA_STATE_KEY,
                    canonical + EXTRA_STATE_KEY,
                    "extra",
                    module,
                    EXTRA_STATE_KEY,
                )
            )
    return entries


def fp8_modules(model: nn.Module) -> list[tuple[str, str, FP8StateMixin]]:
    """``(key prefix, canonical prefix, module)`` of every FP8 module, in state-dict order."""
    return [
        (prefix, canonical, module)
        for prefix, canonical, module in walk_modules(model, "", "")
        if isinstance(module, FP8StateMixin)
    ]


class KeyResolver:
    """Maps a state dict's keys (model spelling or canonical spelling) to model entries."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self._by_key = {e.key: e for e in entries}
        self._by_canonical: dict[str, Entry] = {}
        for e in entries:
            self._by_canonical.setdefault(e.canonical, e)

    def resolve(self, key: str) -> Entry | None:
        """The entry ``key`` names, preferring the model's own spelling."""
        return self._by_key.get(key) or self._by_canonical.get(key)


def iter_extra_states(obj: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    """Yield ``(key, value)`` of every ``*_extra_state`` entry in a (possibly nested) dict.

    Checkpoints often nest the model under a key (``{"model": ..., "optimizer": ...}``); the
    yielded key joins the path with dots (``"model.blocks.0._extra_state"``).
    """
    if not isinstance(obj, Mapping):
        return

    def descend(path: tuple[object, ...], value: object) -> bool:
        # Mappings under string keys; an extra state's own value is not searched.
        return isinstance(value, Mapping) and not (path and is_extra_state_key(str(path[-1])))

    for path, value in walk(obj, descend):
        if path and all(isinstance(k, str) for k in path) and is_extra_state_key(path[-1]):
            yield prefix + ".".join(path), value
