"""End of a step: reduce the recorded amaxes across ranks, then update every module's scales.

One collective per (recipe, group, device) and direction, whatever the number of modules: row
0 of every module's history is concatenated into one buffer, all-reduced with MAX, and written
back before the scales are recomputed. On CUDA the scales of all modules of a group are then
updated by one kernel launch reading the modules' buffers through a cached pointer table;
elsewhere by the pure functions once, on one concatenation of the modules' windows, instead
of a few small ops per module. The arithmetic is the same either way (bit-identical).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fp8state._runtime.buffers import buffer_name
from fp8state._runtime.friend import FP8Friend, close_steps
from fp8state._runtime.generation import buffer_generation
from fp8state._runtime.scale_update import update_direction_
from fp8state._runtime.slot_cast import kernels_available
from fp8state.recipe import DelayedScaling
from fp8state.scaling import shift_histories_
from fp8state.schema import DirectionState
from fp8state.slots import Direction

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["PendingSteps", "open_steps", "reduce_and_update", "should_reduce", "tables_kept"]

_Key = tuple[DelayedScaling, "ProcessGroup | None", torch.device]

# Pointer tables of recent module sets, so a training loop's steady state builds none. A few
# entries: one per (direction, module set) that alternates in a loop, e.g. several models.
_TABLES: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_TABLE_CACHE_SIZE = 16
_FWD_SCALE = buffer_name("fwd", "scale")


class PendingSteps:
    """Modules that recorded amaxes in the current step, grouped by how they reduce.

    Insertion order is forward (or backward) execution order, identical on every rank that
    runs the same model, so the collectives match across ranks.
    """

    def __init__(self) -> None:
        self.groups: dict[_Key, dict[int, FP8Friend]] = {}

    def add(self, module: FP8Friend, recipe: DelayedScaling, group: ProcessGroup | None) -> None:
        """Add ``module`` once per step."""
        # _buffers directly: nn.Module.__getattr__ is slow, and this runs per module per step.
        device = module._buffers[_FWD_SCALE].device  # type: ignore[union-attr]
        self.groups.setdefault((recipe, group, device), {})[id(module)] = module

    def __len__(self) -> int:
        return sum(len(v) for v in self.groups.values())


# While above zero, no table is dropped from the cache (see tables_kept).
_KEEPING = [0]


@contextlib.contextmanager
def tables_kept() -> Iterator[list[Any]]:
    """Keep every pointer table made or used inside the block; yields them at its end.

    CUDA graphs capture launches that read a table's device memory, and building a table
    copies from the host, which a capture refuses: a capture of many modules must find, at
    capture, every table its warm-up built, and must keep them alive as long as the graphs.
    The list yielded is filled when the block ends.
    """
    kept: list[Any] = []
    _KEEPING[0] += 1
    try:
        yield kept
    finally:
        _KEEPING[0] -= 1
        kept.extend(_TABLES.values())


def should_reduce(group: ProcessGroup | None) -> bool:
    """True when ``group`` (None: the default group) spans more than one initialized rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


@torch.no_grad()
def reduce_and_update(direction: Direction, pending: PendingSteps) -> None:
    """Reduce row 0 of every pending module's ``direction`` history, then update its scales."""
    for (recipe, group, device), members in pending.groups.items():
        modules = list(members.values())
        if should_reduce(group):
            open_steps(direction, modules)
            rows = [m.fp8_meta(direction).amax_history[0] for m in modules]
            flat = torch.cat(rows)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
            torch._foreach_copy_(rows, list(flat.split([r.numel() for r in rows])))
        if len(modules) > 1 and kernels_available(device):
            _update_batched(direction, recipe, members)
        elif len(modules) > 1:
            _update_concatenated(direction, recipe, modules)
        else:
            modules[0].fp8_update_scales(direction, recipe)


def open_steps(direction: Direction, modules: list[FP8Friend]) -> None:
    """Open ``direction``'s step of every module that has not recorded in it: row 0 zeros.

    Each history shifts as its step's first record would have shifted it, all in a few
    launches, and the module's next record max-combines into the zero row (the neutral
    element of MAX) as a later record of the step does: the same bits as without this call.
    Used for modules registered without recording, so that every rank reduces the same
    modules (a GEMM that fell back, :mod:`fp8state.functional._take_part`), and by
    ``cast_weights_ahead`` for the modules it casts (one cheap opening for all, where each
    cast that opened its step would shift its history itself).
    """
    unrecorded = [m for m in modules if m._fp8_opens_step(direction)]
    if not unrecorded:
        return
    shift_histories_([m.fp8_meta(direction).amax_history for m in unrecorded])
    for module in unrecorded:
        module._fp8_touch()  # the shift wrote its history
        module._fp8_continue_step(direction)


def _adopt(recipe: DelayedScaling, modules: Iterable[FP8Friend]) -> None:
    """Give every module the step's recipe, as its own update would (it may grow buffers)."""
    for module in modules:
        current = module.fp8_recipe
        if current is not recipe and current != recipe:
            module.fp8_recipe = recipe


def _update_concatenated(
    direction: Direction, recipe: DelayedScaling, modules: list[FP8Friend]
) -> None:
    """Every module's update by one call of the direction's update (no Triton: CPU, MPS, ...).

    The windows of all histories side by side make one history, their scales one vector:
    the max over each column and the elementwise rest are what each module's own update
    computes, so the bits are the same, in a dozen ops instead of a dozen per module.
    """
    _adopt(recipe, modules)
    metas = [m.fp8_meta(direction) for m in modules]
    window = recipe.amax_history_len  # histories may hold more rows: the windows line up
    together = DirectionState(
        torch.cat([m.amax_history[:window] for m in metas], dim=1),
        torch.cat([m.scale for m in metas]),
        torch.cat([m.scale_inv for m in metas]),
    )
    update_direction_(together, recipe, direction)
    sizes = [m.scale.numel() for m in metas]
    torch._foreach_copy_([m.scale for m in metas], list(together.scale.split(sizes)))
    torch._foreach_copy_([m.scale_inv for m in metas], list(together.scale_inv.split(sizes)))
    close_steps(modules, direction)


def _update_batched(
    direction: Direction, recipe: DelayedScaling, members: dict[int, FP8Friend]
) -> None:
    """One kernel launch for every module of ``members`` (CUDA, Triton)."""
    from fp8state._kernels.triton_update import PointerTable, batched_update_scales_

    # A table is cached under the recipe and the replacement count: a hit means every module
    # already has this recipe (changing a module's recipe bumps the count), so the per-module
    # recipe check only runs when the table is built.
    ids = tuple(members)
    table = _TABLES.get((direction, ids, buffer_generation(), recipe))
    if table is None or not table.still_valid():
        _adopt(recipe, members.values())  # may grow buffers: before the table is built
        key = (direction, ids, buffer_generation(), recipe)
        metas = [m.fp8_meta(direction) for m in members.values()]
        table = PointerTable(
            [m.amax_history for m in metas],
            [m.scale for m in metas],
            [m.scale_inv for m in metas],
            recipe.amax_history_len,
        )
        _TABLES[key] = table
        while len(_TABLES) > _TABLE_CACHE_SIZE and not _KEEPING[0]:
            _TABLES.popitem(last=False)
    batched_update_scales_(
        table,
        algo=recipe.amax_compute_algo,
        fp8_max=recipe.fp8_format.max(direction),
        margin=recipe.margin,
    )
    close_steps(members.values(), direction)
