"""Copies of FP8 modules' metadata, put back later into the very same tensors.

Work that runs steps only to learn something (capturing CUDA graphs, timing fallback
thresholds, calibrating) must leave the model as it found it: the FP8 metadata, and the other
buffers a training-mode forward may change (BatchNorm statistics). The copies go back with one
``torch._foreach_copy_`` into the live buffers, never new tensors: captured graphs and the
kernels' pointer tables hold their addresses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from fp8state._runtime.buffers import ALL_BUFFER_NAMES
from fp8state._runtime.friend import FP8Friend
from fp8state.schema import DirectionState
from fp8state.slots import DIRECTIONS, Direction

__all__ = ["MetaSnapshot", "take", "put_back", "SavedBuffer", "take_buffers", "put_back_buffers"]

#: Per module: copies of its buffers in both directions, and its step flags.
MetaSnapshot = list[tuple[FP8Friend, list[DirectionState], dict[Direction, bool]]]


def take(modules: Sequence[FP8Friend]) -> MetaSnapshot:
    """Copies of the metadata and step flags of ``modules``."""
    return [
        (
            m,
            [DirectionState(*(t.clone() for t in m.fp8_meta(d))) for d in DIRECTIONS],
            m._fp8_step_flags(),
        )
        for m in modules
    ]


@torch.no_grad()
def put_back(snapshot: MetaSnapshot) -> None:
    """Copy the saved metadata into the live buffers and restore the step flags.

    A history that grew meanwhile (a recipe with a longer window ran) keeps its length: the
    saved rows go on top and zeros below, as growing the saved history would have made it.
    """
    for module, saved, flags in snapshot:
        live = [t for d in DIRECTIONS for t in module.fp8_meta(d)]
        copies = [t for state in saved for t in state]
        same = [(a, b) for a, b in zip(live, copies, strict=True) if a.shape == b.shape]
        torch._foreach_copy_([a for a, _ in same], [b for _, b in same])
        for grown, rows in zip(live, copies, strict=True):
            if grown.shape != rows.shape:
                grown[: rows.shape[0]].copy_(rows)
                grown[rows.shape[0] :].zero_()
        module._fp8_set_step_flags(flags)
        module._fp8_touch()


SavedBuffer = tuple[nn.Module, str, torch.Tensor, torch.Tensor]


def take_buffers(model: nn.Module, fp8_modules: Iterable[nn.Module]) -> list[SavedBuffer]:
    """Copies of the buffers other than FP8 metadata that a training-mode forward may change.

    ``fp8_modules``: the FP8 modules of ``model``, whose metadata buffers are left out.
    """
    fp8 = {id(m) for m in fp8_modules}
    saved = []
    for module in model.modules():
        if not module.training:
            continue  # an eval-mode forward updates no statistics
        skip = ALL_BUFFER_NAMES if id(module) in fp8 else ()
        for name, buf in module._buffers.items():
            if buf is not None and name not in skip:
                saved.append((module, name, buf, buf.detach().clone()))
    return saved


@torch.no_grad()
def put_back_buffers(saved: list[SavedBuffer]) -> None:
    """Copy each saved buffer back into its tensor, and that tensor back into its module."""
    # Unconditionally: batch_norm updates running statistics inside its kernel, without
    # bumping the tensors' version counters, so there is no cheap way to tell what changed.
    for module, name, buf, copy in saved:
        buf.copy_(copy)
        module._buffers[name] = buf
