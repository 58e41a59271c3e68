"""The fused Triton cast kernel against the pure reference, bit for bit (CUDA + Triton only)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fp8state._runtime.slot_cast import cast_and_record, fused_kernel_available
from fp8state.quantize import finite_amax, quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]


@pytest.mark.parametrize("shape", [(1, 1), (7, 300), (256, 128), (1000, 33), (4096, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_kernel_matches_reference(shape, dtype, fp8_dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(hash(shape) % 2**31)
    x = (torch.randn(*shape, device="cuda", generator=gen) * 30).to(dtype)
    x.view(-1)[0] = float("inf")
    if x.numel() > 2:
        x.view(-1)[1] = float("nan")
    scale = torch.tensor([7.5], device="cuda")
    assert fused_kernel_available(x)
    cell = torch.tensor([0.25], device="cuda")
    got, got_t = cast_and_record(x, scale, cell, fp8_dtype, transpose=True)
    ref = quantize(x, scale, fp8_dtype)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(got_t.view(torch.uint8), ref.t().contiguous().view(torch.uint8))
    expected_amax = torch.maximum(torch.tensor(0.25, device="cuda"), finite_amax(x))
    assert cell.item() == expected_amax.item()
