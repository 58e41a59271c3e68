"""Batched ``get_extra_state``: every module's payload from one device-to-host transfer.

``model.state_dict()`` asks each FP8 module for its extra state in turn; transferring each
module's six small tensors separately costs one device synchronization per module (161 ms for
1000 modules on an H200). Instead, the first request stages the metadata of every live FP8
module on that device with one concatenation and one transfer, then hands each module its
payload when it asks.

A staged payload is handed out once, and only while it is still exact: the module's mutation
counter (bumped by every record, update, load and buffer replacement through the mixin) and
the version counters and identities of its six buffers (bumped by any in-place edit) must be
unchanged since staging. Otherwise the module packs afresh. So a state dict taken right after
training continues is always current, and one taken earlier never changes (its tensors are CPU
copies).

Each module's float32 payload tensors share one small CPU storage of their own (views into a
per-module block), so ``torch.save`` of one module's state writes only that module's bytes
(plus the model's 40 bytes per module of recipe integers, which share one column per key).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from fp8state.cast import kernels_available
from fp8state.generation import buffer_generation
from fp8state.schema import SCHEMA_VERSION

if TYPE_CHECKING:
    from fp8state.mixin import FP8StateMixin

__all__ = ["register", "take", "stage", "BUFFER_NAMES"]

BUFFER_NAMES = tuple(
    f"fp8_{d}_{f}" for d in ("fwd", "bwd") for f in ("amax_history", "scale", "scale_inv")
)
_PAYLOAD_NAMES = tuple(f"{d}.{f}" for d in ("fwd", "bwd")
                       for f in ("amax_history", "scale", "scale_inv"))
_RECIPE_NAMES = ("recipe.fp8_format", "recipe.margin", "recipe.amax_history_len",
                 "recipe.amax_compute_algo")

_LIVE: weakref.WeakSet[FP8StateMixin] = weakref.WeakSet()


@dataclass
class _Staged:
    module: weakref.ref[FP8StateMixin]
    stamp: tuple[object, ...]
    payload: dict[str, torch.Tensor]


# Per device: staging one device must not drop another's entries (a model split over GPUs is
# visited device after device, interleaved).
_STAGED: dict[torch.device, dict[int, _Staged]] = {}


def register(module: FP8StateMixin) -> None:
    """Make ``module`` part of future stagings (weakly: it can still be garbage-collected)."""
    _LIVE.add(module)


def _buffers_of(module: FP8StateMixin) -> list[torch.Tensor]:
    # _buffers directly: nn.Module.__getattr__ is slow, and this runs per module.
    return [cast(torch.Tensor, module._buffers[name]) for name in BUFFER_NAMES]


def _stamp(module: FP8StateMixin) -> tuple[object, ...]:
    return (module._fp8_mutations, module._fp8_recipe,
            *((id(t), t._version) for t in _buffers_of(module)))


def take(module: FP8StateMixin) -> dict[str, torch.Tensor] | None:
    """``module``'s staged payload if it is still exact, else None; handed out once."""
    entry = _STAGED.get(_buffers_of(module)[1].device, {}).pop(id(module), None)
    if entry is None or entry.module() is not module or entry.stamp != _stamp(module):
        return None
    return entry.payload


# The gather table of the last staged module set per device (rebuilt when any module's
# buffers are replaced: fp8state.generation).
_TABLES: dict[torch.device, tuple[tuple[object, ...], Any]] = {}


def _gather(device: torch.device, modules: list[FP8StateMixin],
            buffers: list[list[torch.Tensor]]) -> torch.Tensor:
    """All buffers of all modules, flattened into one tensor in order, on ``device``."""
    if not kernels_available(device):
        return torch.cat([t.reshape(-1) for bufs in buffers for t in bufs])
    from fp8state.kernels.triton_gather import GatherTable, gather

    key = (tuple(id(m) for m in modules), buffer_generation())
    cached = _TABLES.get(device)
    if cached is None or cached[0] != key or not cached[1].still_valid():
        cached = (key, GatherTable([t for bufs in buffers for t in bufs]))
        _TABLES[device] = cached
    return gather(cached[1])


@torch.no_grad()
def stage(device: torch.device) -> None:
    """Stage the payload of every live FP8 module whose metadata is on ``device``."""
    modules = [m for m in list(_LIVE) if m._fp8_num_gemms is not None
               and _buffers_of(m)[1].device == device]
    staged = _STAGED[device] = {}
    if not modules:
        return
    buffers = [_buffers_of(m) for m in modules]
    flat = _gather(device, modules, buffers)
    if device.type == "cuda":
        # On the metadata's own device: pinned memory and events bind to the current device,
        # which may be another GPU that this process must not touch.
        with torch.cuda.device(device):
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            done.synchronize()  # this copy only: no device-wide synchronization
    else:
        host = flat
    scalars = torch.tensor(
        [[SCHEMA_VERSION, *m._fp8_recipe.to_scalars().values()] for m in modules],
        dtype=torch.int64,
    )
    # Five unbinds in all (one per scalar key), not five per module: each scalar key's values
    # for every module are 0-d views of one small int64 column.
    columns = [column.unbind() for column in scalars.t().contiguous()]
    blocks = host.split([sum(t.numel() for t in bufs) for bufs in buffers])
    for i, (module, bufs, block) in enumerate(zip(modules, buffers, blocks, strict=True)):
        parts = block.clone().split([t.numel() for t in bufs])  # this module's own storage
        payload = {"schema_version": columns[0][i]}  # the key order of schema.pack
        for name, part, buf in zip(_PAYLOAD_NAMES, parts, bufs, strict=True):
            payload[name] = part.view(buf.shape) if buf.dim() > 1 else part
        for name, column in zip(_RECIPE_NAMES, columns[1:], strict=True):
            payload[name] = column[i]
        staged[id(module)] = _Staged(weakref.ref(module), _stamp(module), payload)
