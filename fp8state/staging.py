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

The payloads of one staging share one new CPU block (pageable, not pinned): each module's
tensors are views into it, made by one ``unbind`` per buffer kind for all modules of the same
shapes, since creating tens of thousands of tensors one Python call at a time cost more than
the transfer. ``torch.save(model.state_dict())`` writes every byte once; saving a subset of
the state dict writes the whole block, the FP8 metadata of every module staged with it (20 KB
per Linear with history 1024): clone the payloads first to save them apart
(docs/checkpoints.md).
"""

from __future__ import annotations

import gc
import weakref
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
# A payload's keys in schema.pack's order: the version, the six buffers, the recipe's integers.
_NAMES = ("schema_version",
          *(f"{d}.{f}" for d in ("fwd", "bwd") for f in ("amax_history", "scale", "scale_inv")),
          "recipe.fp8_format", "recipe.margin", "recipe.amax_history_len",
          "recipe.amax_compute_algo")

_LIVE: weakref.WeakSet[FP8StateMixin] = weakref.WeakSet()


# id(module) -> (weakref to it, its metadata's device, stamp, payload). One dict for all
# devices: staging one device must not drop another's entries (a model split over GPUs is
# visited device after device, interleaved).
_STAGED: dict[int, tuple[weakref.ref[FP8StateMixin], torch.device, tuple[object, ...],
                         dict[str, torch.Tensor]]] = {}


def register(module: FP8StateMixin) -> None:
    """Make ``module`` part of future stagings (weakly: it can still be garbage-collected)."""
    _LIVE.add(module)


def _buffers_of(module: FP8StateMixin) -> list[torch.Tensor]:
    # _buffers directly: nn.Module.__getattr__ is slow, and this runs per module.
    buffers = module._buffers
    return [cast(torch.Tensor, buffers[name]) for name in BUFFER_NAMES]


def _stamp(module: FP8StateMixin, bufs: list[torch.Tensor]) -> tuple[object, ...]:
    return (module._fp8_mutations, module._fp8_recipe, *map(id, bufs),
            *[t._version for t in bufs])


def take(module: FP8StateMixin) -> dict[str, torch.Tensor] | None:
    """``module``'s staged payload if it is still exact, else None; handed out once."""
    entry = _STAGED.pop(id(module), None)
    if entry is None or entry[0]() is not module or entry[2] != _stamp(module,
                                                                       _buffers_of(module)):
        return None
    return entry[3]


# The gather table of the last staged module set per device (rebuilt when any module's
# buffers are replaced: fp8state.generation).
_TABLES: dict[torch.device, tuple[tuple[object, ...], Any]] = {}


def _gather(device: torch.device, modules: list[FP8StateMixin],
            tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` (the buffers of ``modules``) flattened into one tensor in order, on CUDA."""
    from fp8state.kernels.triton_gather import GatherTable, gather

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
    groups: dict[tuple[torch.Size, ...], list[tuple[FP8StateMixin, list[torch.Tensor]]]] = {}
    for module in list(_LIVE):
        if module._fp8_num_gemms is None:
            continue
        bufs = _buffers_of(module)
        if bufs[1].device == device:
            groups.setdefault(tuple(t.shape for t in bufs), []).append((module, bufs))
    if not groups:
        return
    # Kind-major within each group of equal shapes: all modules' forward histories, then all
    # forward scales, ... so that one unbind() per kind makes every module's view at once.
    members = [member for group in groups.values() for member in group]
    kinds = [(shapes[k], [bufs[k] for _, bufs in group])
             for shapes, group in groups.items() for k in range(len(BUFFER_NAMES))]
    host = _to_host(device, [m for m, _ in members], kinds)
    per_kind: list[list[torch.Tensor]] = [[] for _ in BUFFER_NAMES]
    offset = 0
    for i, (shape, tensors) in enumerate(kinds):
        size = len(tensors) * shape.numel()
        per_kind[i % len(BUFFER_NAMES)].extend(
            host[offset:offset + size].view(len(tensors), *shape).unbind(0))
        offset += size
    rows: dict[object, list[int]] = {}  # most models have one recipe: build its row once
    scalars = torch.tensor(
        [rows.get(r) or rows.setdefault(r, [SCHEMA_VERSION, *r.to_scalars().values()])
         for r in (m._fp8_recipe for m, _ in members)],
        dtype=torch.int64,
    )
    # One unbind per scalar key, not five 0-d tensors per module.
    columns = [column.unbind() for column in scalars.t().contiguous()]
    for (module, bufs), *values in zip(members, columns[0], *per_kind, *columns[1:],
                                       strict=True):
        _STAGED[id(module)] = (weakref.ref(module), device, _stamp(module, bufs),
                               dict(zip(_NAMES, values, strict=True)))


def _to_host(device: torch.device, modules: list[FP8StateMixin],
             kinds: list[tuple[torch.Size, list[torch.Tensor]]]) -> torch.Tensor:
    """Every tensor of ``kinds``, in order, flattened into one new CPU float32 tensor."""
    total = sum(len(tensors) * shape.numel() for shape, tensors in kinds)
    if not kernels_available(device):
        flat = torch.empty(total, dtype=torch.float32, device=device)
        offset = 0
        for shape, tensors in kinds:  # one stack per kind, not one copy per tensor
            size = len(tensors) * shape.numel()
            torch.stack(tensors, out=flat[offset:offset + size].view(len(tensors), *shape))
            offset += size
        if device.type != "cuda":  # the CPU itself, or a device without pinned transfers
            return flat if device.type == "cpu" else flat.cpu()
    else:
        flat = _gather(device, modules, [t for _, tensors in kinds for t in tensors])
    # On the metadata's own device: pinned memory and events bind to the current device,
    # which may be another GPU that this process must not touch.
    with torch.cuda.device(device):
        pinned = torch.empty(total, dtype=torch.float32, pin_memory=True)
        pinned.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()  # this copy only: no device-wide synchronization
    # Pageable memory of its own: a state dict kept for long must not pin host memory, and
    # the pinned block goes back to PyTorch's cache for the next state_dict().
    return torch.empty(total, dtype=torch.float32).copy_(pinned)
