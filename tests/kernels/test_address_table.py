"""Address tables of the batched kernels notice tensors whose memory moved."""

from __future__ import annotations

import torch

from fp8state._kernels.addresses import AddressTable


def test_still_valid_until_a_tensor_data_swap() -> None:
    tensors = [torch.zeros(3), torch.zeros(2)]
    table = AddressTable(tensors)
    assert table.still_valid()
    tensors[1].data = torch.ones(2)  # what FSDP2 does to move a buffer: same object, new memory
    assert not table.still_valid()


def test_addresses_are_the_data_pointers() -> None:
    tensors = [torch.zeros(4), torch.zeros(1)]
    addresses = AddressTable.addresses(tensors, torch.device("cpu"))
    assert addresses.dtype == torch.int64
    assert addresses.tolist() == [t.data_ptr() for t in tensors]
