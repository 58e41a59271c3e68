"""The torch._scaled_mm backend on an FP8-capable GPU, checked against the emulation.

Skipped without such a GPU (CI has none); run on an H200 with
``python -m pytest -q tests/gpu`` (figures in docs/benchmarks.md).
"""

from __future__ import annotations

import pytest
import torch
from _helpers.numerics import sqnr

import fp8state
from fp8state.backends import fp8_gemm, scaled_mm_support
from fp8state.cli._demo.training import DemoConfig, run_demo
from fp8state.quantize import quantize

_CUDA = torch.device("cuda")
_OK, _REASON = (
    scaled_mm_support(_CUDA)
    if torch.cuda.is_available()
    else (False, "torch.cuda.is_available() is False")
)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _OK, reason=_REASON)]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_scaled_mm_matches_emulation(out_dtype: torch.dtype, b_dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, 128, device=_CUDA, generator=gen)
    b = torch.randn(128, 64, device=_CUDA, generator=gen)
    scale_a, scale_b = torch.tensor(100.0, device=_CUDA), torch.tensor(30.0, device=_CUDA)
    a_fp8 = quantize(a, scale_a, torch.float8_e4m3fn)
    b_fp8 = quantize(b, scale_b, b_dtype)
    args = (a_fp8, 1 / scale_a, b_fp8, 1 / scale_b, out_dtype)
    fast, used = fp8_gemm(*args, backend="scaled_mm")
    slow, _ = fp8_gemm(*args, backend="emulated")
    assert used == "scaled_mm"
    # Same FP8 operands: differences are the tensor cores' accumulation and output rounding
    # only. Elementwise tolerances fail on outputs near 0 after cancellation (an H200 run had
    # 4 of 16384 float32 outputs 6.5e-3 apart, 8% relative), so the bound is on the whole.
    assert sqnr(slow, fast) >= 40.0


def test_unaligned_shapes_fall_back_to_emulation() -> None:
    a = quantize(
        torch.randn(8, 24, device=_CUDA), torch.tensor(1.0, device=_CUDA), torch.float8_e4m3fn
    )
    b = quantize(
        torch.randn(24, 8, device=_CUDA), torch.tensor(1.0, device=_CUDA), torch.float8_e4m3fn
    )
    one = torch.tensor(1.0, device=_CUDA)
    _, used = fp8_gemm(a, one, b, one, torch.bfloat16, backend="scaled_mm")
    assert used == "emulated"


def test_auto_backend_picks_scaled_mm_on_gpu() -> None:
    layer = fp8state.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
    layer.fp8_min_gemm_macs = 0  # force FP8 at this small shape
    with fp8state.fp8_autocast():
        y = layer(torch.randn(32, 64, device=_CUDA, dtype=torch.bfloat16))
    y.float().sum().backward()
    assert layer.fp8_last_gemm_backend == "scaled_mm"
    assert layer.fp8_meta("bwd").scale[0] != 1


def test_demo_resumes_exactly_on_gpu() -> None:
    device = torch.device("cuda:0")
    resume = torch.device(f"cuda:{1 % torch.cuda.device_count()}")
    result = run_demo(DemoConfig(steps=40), device, resume)
    assert result.backend == "scaled_mm"
    assert result.resume_exact, (result.losses, result.resumed_losses)


def test_small_gemms_fall_back_on_gpu_by_default() -> None:
    layer = fp8state.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(32, 64, device=_CUDA, dtype=torch.bfloat16)
    with fp8state.fp8_autocast():
        y = layer(x)
    assert layer.fp8_last_gemm_backend == "high_precision"
    torch.testing.assert_close(
        y, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=0, rtol=0
    )
