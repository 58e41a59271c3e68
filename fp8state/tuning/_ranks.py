"""How the ranks of a process group tune alike: the same candidates, the slowest rank's time.

Ranks may run GEMMs of other sizes (batches of other lengths): every rank times every size
that any rank heard, so the candidates are the same everywhere, and every rank picks from
the same times, the slowest rank's, so all keep one threshold. Where that threshold falls
between two ranks' sizes of one GEMM, the ranks decide differently for it, which the amax
reductions allow (a fallback still takes part: ``fp8state.functional._take_part``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fp8state._runtime.amax_reduction import should_reduce

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["union_over_ranks", "slowest_over_ranks"]


def _device(group: ProcessGroup | None) -> torch.device:
    """Where the group's collectives take tensors: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def union_over_ranks(sizes: list[int], group: ProcessGroup | None) -> list[int]:
    """Every size any rank of ``group`` heard, ascending (``sizes`` alone when not distributed)."""
    if not should_reduce(group):
        return sorted(set(sizes))
    device = _device(group)
    longest = torch.tensor([len(sizes)], dtype=torch.int64, device=device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    if not int(longest.item()):
        return []
    mine = torch.full((int(longest.item()),), -1, dtype=torch.int64, device=device)
    mine[: len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return sorted({size for ranks in gathered for size in ranks.tolist() if size >= 0})


def slowest_over_ranks(times: list[float], group: ProcessGroup | None) -> list[float]:
    """Per entry, the largest of the ranks' ``times`` (``times`` itself when not distributed)."""
    if not should_reduce(group):
        return times
    reduced = torch.tensor(times, dtype=torch.float64, device=_device(group))
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in reduced.tolist()]
