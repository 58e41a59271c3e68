"""Device-side tables of tensor addresses, shared by the kernels that take many tensors at once."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["AddressTable"]


class AddressTable:
    """Keeps ``tensors`` alive and remembers where they live.

    Subclasses put the addresses on the device for a kernel (:meth:`addresses`); callers check
    :meth:`still_valid` before reuse, because ``tensor.data = ...`` (FSDP2 moves buffers so)
    changes a tensor's memory without replacing the tensor object or bumping fp8state's
    replacement count (fp8state._runtime.generation).
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._keep = tuple(tensors)
        self._ptrs = [t.data_ptr() for t in self._keep]

    def still_valid(self) -> bool:
        """Whether every tensor still lives where the table says."""
        # map over the unbound method: no Python frame per tensor (thousands per step).
        return list(map(torch.Tensor.data_ptr, self._keep)) == self._ptrs

    @staticmethod
    def addresses(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """An int64 tensor on ``device`` of the tensors' data pointers."""
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)
