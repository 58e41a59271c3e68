"""End of a step: reduce the recorded amaxes across ranks, then update every module's scales.

One collective per (recipe, group, device) and direction, whatever the number of modules: row
0 of every module's history is concatenated into one buffer, all-reduced with MAX, and written
back before the scales are recomputed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fp8state.recipe import DelayedScaling

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from fp8state.mixin import FP8StateMixin

__all__ = ["PendingSteps", "reduce_and_update", "should_reduce"]

_Key = tuple[DelayedScaling, "ProcessGroup | None", torch.device]


class PendingSteps:
    """Modules that recorded amaxes in the current step, grouped by how they reduce.

    Insertion order is forward (or backward) execution order, identical on every rank that
    runs the same model, so the collectives match across ranks.
    """

    def __init__(self) -> None:
        self.groups: dict[_Key, dict[int, FP8StateMixin]] = {}

    def add(self, module: FP8StateMixin, recipe: DelayedScaling, group: ProcessGroup | None
            ) -> None:
        """Add ``module`` once per step."""
        device = module.fp8_meta("fwd").scale.device
        self.groups.setdefault((recipe, group, device), {})[id(module)] = module

    def __len__(self) -> int:
        return sum(len(v) for v in self.groups.values())


def should_reduce(group: ProcessGroup | None) -> bool:
    """True when ``group`` (None: the default group) spans more than one initialized rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


@torch.no_grad()
def reduce_and_update(direction: str, pending: PendingSteps) -> None:
    """Reduce row 0 of every pending module's ``direction`` history, then update its scales."""
    for (recipe, group, _device), members in pending.groups.items():
        modules = list(members.values())
        if should_reduce(group):
            rows = [m.fp8_meta(direction).amax_history[0] for m in modules]
            flat = torch.cat(rows)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
            for row, reduced in zip(rows, flat.split([r.numel() for r in rows]), strict=True):
                row.copy_(reduced)
        for module in modules:
            module.fp8_update_scales(direction, recipe)
