"""Tied weights in plain checkpoints: one tensor under several keys of a model.

A model whose output head shares the embedding's ``nn.Parameter`` has both keys in its
``state_dict()``, but safetensors files hold one name per shared tensor
(``safetensors.torch.save_model`` drops the others, and so do Hugging Face's files). The plain
loader fills a key such a file lacks through its tie; the safetensors writer drops the same
names ``save_model`` would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fp8state.checkpoint._entries import Entry, KeyResolver

__all__ = ["tied_fills", "shared_tensor_names"]


def tied_fills(resolver: KeyResolver, state_dict: Mapping[Any, Any]) -> dict[str, Any]:
    """``{model key: key in state_dict}`` for each key the state dict lacks but fills by a tie.

    A parameter or buffer missing from ``state_dict`` is filled when the very same tensor
    object (the same ``nn.Parameter``) sits under another key of the model that
    ``state_dict`` does hold.
    """
    present: set[str] = set()
    source_of: dict[int, Any] = {}  # id(live tensor) -> the state dict's key that holds it
    for key in state_dict:
        entry = resolver.resolve(key) if isinstance(key, str) else None
        if entry is None or entry.kind == "extra":
            continue
        present.add(entry.key)
        source_of.setdefault(id(entry.tensor()), key)
    fills: dict[str, Any] = {}
    for entry in resolver.entries:
        if entry.kind == "extra" or entry.key in present:
            continue
        source = source_of.get(id(entry.tensor()))
        if source is not None:
            fills[entry.key] = source
    return fills


def _identity(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same tensor: storage, offset, shape, strides, dtype."""
    if isinstance(tensor, DTensor) or nn.parameter.is_lazy(tensor):
        return None
    if tensor.device.type == "meta":
        return None
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def shared_tensor_names(entries: list[Entry], names: Mapping[str, str]) -> dict[str, list[str]]:
    """``{kept name: [dropped names]}`` for every tensor the model holds under several keys.

    Names are the plain ones (``names`` maps model keys to them); as in
    ``safetensors.torch.save_model``, the alphabetically first name of each group is kept.
    """
    groups: dict[tuple[Any, ...], list[str]] = {}
    for entry in entries:
        tensor = entry.tensor() if entry.kind != "extra" else None
        ident = None if tensor is None else _identity(tensor)
        if ident is not None:
            groups.setdefault(ident, []).append(names.get(entry.key, entry.key))
    out: dict[str, list[str]] = {}
    for group in groups.values():
        ordered = sorted(set(group))
        if len(ordered) > 1:
            out[ordered[0]] = ordered[1:]
    return out
