"""Gather many small CUDA tensors into one flat buffer in one launch (pointer table, cached).

``torch.cat`` of thousands of tiny tensors costs thousands of Python-side reshapes and dozens
of launches; staging a model's FP8 metadata for ``state_dict()`` needs exactly this gather, with
the same tensors every time, so the addresses are kept in a device-side table.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fp8state._kernels.addresses import AddressTable

__all__ = ["GatherTable", "gather"]

_BLOCK = 1024


@triton.jit
def _gather_kernel(ptrs, sizes, offsets, out_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    size = tl.load(sizes + i)
    if chunk * BLOCK < size:
        src = tl.load(ptrs + i).to(tl.pointer_type(tl.float32))
        offset = tl.load(offsets + i)
        idx = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = idx < size
        tl.store(out_ptr + offset + idx, tl.load(src + idx, mask=mask), mask=mask)


class GatherTable(AddressTable):
    """Addresses, sizes and offsets of contiguous float32 tensors to gather, on their device.

    Valid while those exact tensors are alive and unchanged in shape; it keeps them alive.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        super().__init__(tensors)
        device = tensors[0].device
        sizes = [t.numel() for t in tensors]
        offsets = [0]
        for size in sizes[:-1]:
            offsets.append(offsets[-1] + size)
        self.total = offsets[-1] + sizes[-1]
        self.count = len(tensors)
        self.chunks = triton.cdiv(max(sizes), _BLOCK)
        self.ptrs = self.addresses(tensors, device)
        self.sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device=device)


def gather(table: GatherTable) -> torch.Tensor:
    """One flat float32 tensor holding every table tensor's elements, in table order."""
    out = torch.empty(table.total, dtype=torch.float32, device=table.ptrs.device)
    # Triton launches on the current device; the tensors may live on another GPU.
    with torch.cuda.device(table.ptrs.device):
        _gather_kernel[(table.count, table.chunks)](
            table.ptrs, table.sizes, table.offsets, out, BLOCK=_BLOCK
        )
    return out
