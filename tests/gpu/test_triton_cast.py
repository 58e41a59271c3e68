"""The fused Triton cast kernel against the pure reference, bit for bit (CUDA + Triton only)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _helpers.numerics import past_the_maximum

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


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(64, 128), (61, 130)])  # whole tiles, and cut ones
def test_saturation_and_rounding_at_the_edges_match_reference(fp8_dtype, shape) -> None:
    """Values around the FP8 maximum, beyond it, infinities, NaN, ties and subnormals.

    Float32 operands are clamped before the conversion; bf16 and fp16 ones are left to the
    conversion's own saturation (values past the maximum and infinities for those:
    test_kernel_matches_reference). Either way the bits are clamping's and then converting's.
    """
    top = torch.finfo(fp8_dtype).max
    edges = torch.tensor(
        [*past_the_maximum(fp8_dtype), 1e-30]
        + [2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-17, 1.0625, 1.1875, 0.0, float("nan")],
        device="cuda",
    )
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(*shape, device="cuda", generator=gen) * top
    flat = x.view(-1)
    flat[: edges.numel()] = edges
    flat[edges.numel() : 2 * edges.numel() - 1] = -edges[:-1]  # NaN's sign is left aside
    scale = torch.ones(1, device="cuda")
    assert fused_kernel_available(x)
    cell = torch.zeros(1, device="cuda")
    got, got_t = cast_and_record(x, scale, cell, fp8_dtype, transpose=True)
    ref = quantize(x, scale, fp8_dtype)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(got_t.view(torch.uint8), ref.t().contiguous().view(torch.uint8))
    assert cell.item() == finite_amax(x).item()


def test_devices_that_round_twice_take_the_reference_path(monkeypatch) -> None:
    """A device whose FP8 conversion is not one rounding (capability below 9.0) gets no
    fused cast; the reference path gives the bits the CPU gives."""
    import fp8state._runtime.slot_cast as slot_cast

    x = (torch.randn(256, 128, device="cuda") * 100).to(torch.bfloat16)
    scale = torch.tensor([3.0], device="cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 9))
    slot_cast.converts_in_one_rounding.cache_clear()
    try:
        assert not fused_kernel_available(x)
        cell = torch.zeros(1, device="cuda")
        got, got_t = cast_and_record(x, scale, cell, torch.float8_e4m3fn, transpose=True)
    finally:
        monkeypatch.undo()
        slot_cast.converts_in_one_rounding.cache_clear()
    ref = quantize(x.cpu(), scale.cpu(), torch.float8_e4m3fn)
    assert torch.equal(got.cpu().view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(got_t.cpu().view(torch.uint8), ref.t().contiguous().view(torch.uint8))
    assert cell.item() == finite_amax(x.cpu()).item()
    assert fused_kernel_available(x)  # the real device again
