"""Batched ``get_extra_state``: every module's payload from one device-to-host transfer.

``model.state_dict()`` asks each FP8 module for its extra state in turn; transferring each
module's six small tensors separately costs one device synchronization per module (161 ms for
1000 modules on an H200). Instead, the first request stages the metadata of every live FP8
module on that device with one gather and one transfer, then hands each module its payload
when it asks.

A staged payload is handed out once, and only while it is still exact: the module's mutation
counter (bumped by every record, update, load and buffer replacement through the mixin) and
the version counters and identities of its six buffers (bumped by any in-place edit, except
one made through ``.data``, which PyTorch does not count) must be unchanged since staging.
Otherwise the module packs afresh. So a state dict taken right after training continues is
always current, and one taken earlier never changes (its tensors are CPU copies).

Each module's payload is a CPU tensor with a storage of its own (its header, then its part of
the staged block, copied together), so ``torch.save`` of one module's state, or of one model's
while other models live in the process (an EMA copy, a teacher), writes only those modules'
bytes, and safetensors (which refuses tensors sharing memory) takes every payload.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, cast

import torch

from fp8state._layout import header_ints
from fp8state._runtime.buffers import ALL_BUFFER_NAMES
from fp8state._runtime.friend import FP8Friend
from fp8state._runtime.generation import buffer_generation
from fp8state._runtime.slot_cast import kernels_available
from fp8state.schema import SCHEMA_VERSION
from fp8state.slots import FWD_SLOTS_PER_GEMM

__all__ = ["register", "take", "stage"]

_LIVE: weakref.WeakSet[FP8Friend] = weakref.WeakSet()


# id(module) -> (weakref to it, its metadata's device, stamp, payload). One dict for all
# devices: staging one device must not drop another's entries (a model split over GPUs is
# visited device after device, interleaved).
_STAGED: dict[
    int, tuple[weakref.ref[FP8Friend], torch.device, tuple[object, ...], torch.Tensor]
] = {}


def register(module: FP8Friend) -> None:
    """Make ``module`` part of future stagings (weakly: it can still be garbage-collected)."""
    _LIVE.add(module)


def _buffers_of(module: FP8Friend) -> list[torch.Tensor]:
    # _buffers directly: nn.Module.__getattr__ is slow, and this runs per module.
    buffers = module._buffers
    return cast(list[torch.Tensor], [buffers[name] for name in ALL_BUFFER_NAMES])


def _stamp(module: FP8Friend, bufs: list[torch.Tensor]) -> tuple[object, ...]:
    return (
        module._fp8_mutation_count(),
        module.fp8_recipe,
        *map(id, bufs),
        *[t._version for t in bufs],
    )


def take(module: FP8Friend) -> torch.Tensor | None:
    """``module``'s staged payload if it is still exact, else None; handed out once."""
    entry = _STAGED.pop(id(module), None)
    if entry is None or entry[0]() is not module or entry[2] != _stamp(module, _buffers_of(module)):
        return None
    return entry[3]


# The gather table of the last staged module set per device (rebuilt when any module's
# buffers are replaced: fp8state._runtime.generation).
_TABLES: dict[torch.device, tuple[tuple[object, ...], Any]] = {}


def _gather(
    device: torch.device, modules: list[FP8Friend], tensors: list[torch.Tensor]
) -> torch.Tensor:
    """``tensors`` (the buffers of ``modules``) flattened into one tensor in order, on CUDA."""
    from fp8state._kernels.triton_gather import GatherTable, gather

    key = (tuple(id(m) for m in modules), buffer_generation())
    cached = _TABLES.get(device)
    if cached is None or cached[0] != key or not cached[1].still_valid():
        cached = (key, GatherTable(tensors))
        _TABLES[device] = cached
    return cast(torch.Tensor, gather(cached[1]))


@torch.no_grad()
def stage(device: torch.device) -> None:
    """Stage the payload of every live FP8 module whose metadata is on ``device``."""
    # Tens of thousands of new objects, none in a reference cycle: without this, Python's
    # cyclic collector runs dozens of times meanwhile and walks every object of the process
    # (a large model) in its older generations; it still runs afterwards, once.
    collecting = gc.isenabled()
    gc.disable()
    try:
        _stage(device)
    finally:
        if collecting:
            gc.enable()


def _stage(device: torch.device) -> None:
    for key in [key for key, entry in _STAGED.items() if entry[1] == device]:
        del _STAGED[key]  # another device's entries stay (a split model is visited in turns)
    members: list[tuple[FP8Friend, list[torch.Tensor]]] = []
    for module in list(_LIVE):
        if module._fp8_has_meta():
            bufs = _buffers_of(module)
            if bufs[1].device == device:
                members.append((module, bufs))
    if not members:
        return
    recipes: dict[object, list[int]] = {}  # most models have one recipe: convert it once
    # Each module's packed header (fp8state._layout): version, GEMMs, rows, the recipe.
    headers = torch.tensor(
        [
            header_ints(
                SCHEMA_VERSION,
                bufs[1].shape[0] // FWD_SLOTS_PER_GEMM,
                bufs[0].shape[0],
                _recipe_ints(module.fp8_recipe, recipes),
            )
            for module, bufs in members
        ],
        dtype=torch.float32,
        device="cpu",  # not a `with torch.device(...)` default
    ).unbind()
    for (module, bufs), payload in zip(
        members, _packed_payloads(device, members, headers), strict=True
    ):
        _STAGED[id(module)] = (weakref.ref(module), device, _stamp(module, bufs), payload)


def _recipe_ints(recipe: Any, known: dict[object, list[int]]) -> list[int]:
    """``recipe``'s integers, converted once per distinct recipe of a staging."""
    ints = known.get(recipe)
    if ints is None:
        ints = known[recipe] = list(recipe.to_scalars().values())
    return ints


def _packed_payloads(
    device: torch.device,
    members: list[tuple[FP8Friend, list[torch.Tensor]]],
    headers: tuple[torch.Tensor, ...],
) -> list[torch.Tensor]:
    """Per module, a new CPU float32 tensor: its header, then its six buffers in order."""
    if device.type == "cpu":
        return [
            torch.cat([head, *(t.reshape(-1) for t in bufs)])
            for head, (_, bufs) in zip(headers, members, strict=True)
        ]
    tensors = [t for _, bufs in members for t in bufs]
    if kernels_available(device):
        flat = _gather(device, [m for m, _ in members], tensors)
    else:
        flat = torch.cat([t.reshape(-1) for t in tensors])
    if device.type != "cuda":  # a device without pinned transfers
        return _with_headers(flat.cpu(), members, headers)
    # On the metadata's own device: pinned memory and events bind to the current device,
    # which may be another GPU that this process must not touch.
    with torch.cuda.device(device):
        pinned = torch.empty(flat.shape, dtype=flat.dtype, device="cpu", pin_memory=True)
        pinned.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()  # this copy only: no device-wide synchronization
    # Each payload is copied out of the pinned block, which goes back to PyTorch's cache.
    return _with_headers(pinned, members, headers)


def _with_headers(
    host: torch.Tensor,
    members: list[tuple[FP8Friend, list[torch.Tensor]]],
    headers: tuple[torch.Tensor, ...],
) -> list[torch.Tensor]:
    """Per module, its header and its part of ``host``, concatenated into a new tensor."""
    sizes = [sum([t.numel() for t in bufs]) for _, bufs in members]
    return [torch.cat([head, part]) for head, part in zip(headers, host.split(sizes), strict=True)]
