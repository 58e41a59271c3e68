"""How the ranks of a process group tune alike: the same candidates, the slowest rank's time.

Ranks must run the same GEMMs in FP8: the end-of-step amax reduction concatenates the
histories of the modules that ran in FP8, so ranks that disagree would reduce buffers of
different lengths, or pair one module's amaxes with another's. Every rank therefore times the
same candidates (the tuner refuses ranks whose steps' GEMM sizes differ) and picks from the
same times, the slowest rank's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fp8state._runtime.amax_reduction import should_reduce

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["same_on_every_rank", "slowest_over_ranks"]


def _device(group: ProcessGroup | None) -> torch.device:
    """Where the group's collectives take tensors: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def same_on_every_rank(sizes: list[int], group: ProcessGroup | None) -> bool:
    """Whether every rank of ``group`` heard exactly ``sizes`` (True when not distributed)."""
    if not should_reduce(group):
        return True
    device = _device(group)
    source = dist.get_global_rank(group, 0) if group is not None else 0
    count = torch.tensor([len(sizes)], dtype=torch.int64, device=device)
    dist.broadcast(count, source, group=group)
    first = torch.zeros(int(count.item()), dtype=torch.int64, device=device)
    if dist.get_rank(group) == 0:
        first.copy_(torch.tensor(sizes, dtype=torch.int64))
    dist.broadcast(first, source, group=group)
    differs = torch.tensor([float(first.tolist() != sizes)], device=device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
    return not bool(differs.item())


def slowest_over_ranks(times: list[float], group: ProcessGroup | None) -> list[float]:
    """Per entry, the largest of the ranks' ``times`` (``times`` itself when not distributed)."""
    if not should_reduce(group):
        return times
    reduced = torch.tensor(times, dtype=torch.float64, device=_device(group))
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in reduced.tolist()]
