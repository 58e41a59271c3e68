"""state_dict() of a CUDA model: one gathered transfer, payloads equal to per-module packing."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import fp8state
from fp8state._runtime import staging
from fp8state.schema import pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_state_dict_matches_pack_and_never_synchronizes_the_device(monkeypatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *(fp8state.Linear(32, 32, device="cuda") for _ in range(20)),
        fp8state.LayerNormMLP(32, 64, device="cuda"),
    )
    for m in model:
        m.fp8_min_gemm_macs = 0
    with fp8state.fp8_autocast():
        y = model(torch.randn(16, 32, device="cuda"))
    y.sum().backward()
    monkeypatch.setattr(
        torch.cuda,
        "synchronize",
        lambda *a: (_ for _ in ()).throw(AssertionError("device-wide sync")),
    )
    calls = []
    real = staging.stage
    monkeypatch.setattr(staging, "stage", lambda d: (calls.append(d), real(d))[1])
    sd = model.state_dict()
    assert len(calls) == 1
    for i, module in enumerate(model):
        expected = pack(module.fp8_state())  # the packed schema-2 tensor, on the CPU
        got = sd[f"{i}._extra_state"]
        assert got.device.type == "cpu" and expected.device.type == "cpu"
        assert torch.equal(got, expected), i


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_gather_kernel_matches_cat() -> None:
    from fp8state._kernels.triton_gather import GatherTable, gather

    tensors = [torch.randn(n, device="cuda") for n in (1, 3, 1024 * 3, 5000, 2)]
    assert torch.equal(gather(GatherTable(tensors)), torch.cat(tensors))
