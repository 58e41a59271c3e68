"""The performance features, checked for behaviour on CPU: weight caching across micro-batches,
the small-GEMM fallback, FP8-only saved activations and the cast entry point."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fp8state
from fp8state._runtime import slot_cast
from fp8state._runtime.slot_cast import cast_and_record, fused_kernel_available
from fp8state.backends import DEFAULT_MIN_GEMM_MACS, GRAPHED_MIN_GEMM_MACS, min_gemm_macs
from fp8state.quantize import finite_amax, quantize

H = 32


def test_weight_is_cast_once_per_step_with_is_first_microbatch(seed: int) -> None:
    layer = fp8state.Linear(H, H)
    x = torch.randn(8, H)
    with fp8state.fp8_autocast():
        first = layer(x, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight.mul_(2.0)  # the cached FP8 copy must not see this
        reused = layer(x, is_first_microbatch=False)
        recast = layer(x)
    torch.testing.assert_close(reused, first, atol=0, rtol=0)
    assert not torch.equal(recast, first)


def test_weight_cache_is_dropped_when_metadata_is_loaded(seed: int) -> None:
    layer = fp8state.Linear(H, H)
    with fp8state.fp8_autocast():
        layer(torch.randn(8, H), is_first_microbatch=True)
    assert layer.fp8_weight_cache
    layer.load_state_dict(layer.state_dict())
    assert not layer.fp8_weight_cache


def test_weight_cache_does_not_outlive_a_device_move(seed: int) -> None:
    layer = fp8state.Linear(16, 16)
    with fp8state.fp8_autocast():
        layer(torch.randn(4, 16), is_first_microbatch=True)
    assert layer.fp8_weight_cache
    layer.to("meta")  # stands in for .cuda() / .to("cpu") on a machine without a second device
    cached = [t for entry in layer.fp8_weight_cache.values() for t in entry if t is not None]
    assert all(t.device == layer.weight.device for t in cached)


def test_small_gemms_fall_back_to_exact_high_precision(seed: int) -> None:
    layer = fp8state.Linear(H, H)
    layer.fp8_min_gemm_macs = 8 * H * H + 1  # an 8-token batch is just below it
    x = torch.randn(8, H, requires_grad=True)
    with fp8state.fp8_autocast():
        y = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), atol=0, rtol=0)
    assert layer.fp8_last_gemm_backend == "high_precision"
    assert not layer.fp8_meta("fwd").amax_history.any()
    with fp8state.fp8_autocast():
        layer(torch.randn(16, H))  # large enough: FP8
    assert layer.fp8_last_gemm_backend == "emulated"


def test_fallback_thresholds() -> None:
    for graphed in (False, True):
        assert min_gemm_macs("emulated", None, graphed) == 0  # CPU tests always exercise FP8
        assert min_gemm_macs("scaled_mm", 0, graphed) == 0  # an override wins
        assert min_gemm_macs("scaled_mm", 12345, graphed) == 12345
    eager = min_gemm_macs("scaled_mm", None)
    graphed = min_gemm_macs("scaled_mm", None, graphed=True)
    assert eager == DEFAULT_MIN_GEMM_MACS["scaled_mm"]
    assert graphed == GRAPHED_MIN_GEMM_MACS["scaled_mm"]
    # Graphs take the host's launch cost out: FP8 pays from smaller GEMMs there. Eagerly,
    # a 2048-token 2048x2048 GEMM stays in high precision; graphed, it runs in FP8.
    assert 2048 * 1024 * 1024 < graphed <= 2048 * 2048 * 2048 < eager <= 2048 * 8192 * 8192


def test_graphed_modules_take_the_graphed_default() -> None:
    layer = fp8state.Linear(H, H)
    assert layer.fp8_graphed is False  # until make_graphed_callables marks it
    # The emulation never falls back, graphed or not, so CPU steps stay FP8 either way.
    layer.fp8_graphed = True
    with fp8state.fp8_autocast():
        layer(torch.randn(8, H))
    assert layer.fp8_last_gemm_backend == "emulated"
    layer.fp8_min_gemm_macs = 8 * H * H + 1  # an explicit threshold still applies
    with fp8state.fp8_autocast():
        layer(torch.randn(8, H))
    assert layer.fp8_last_gemm_backend == "high_precision"


def test_backward_keeps_only_fp8_copies(seed: int) -> None:
    layer = fp8state.LayerNormMLP(H, 2 * H)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x = torch.randn(16, H, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fp8state.fp8_autocast():
        y = layer(x)
    y.sum().backward()
    fp8_saved = [t for t in saved if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    # fc1 and fc2 each keep their input and weight as FP8 transposes, nothing in float32 of
    # the GEMM inputs' size (the norm and activation save their own, as in torch.nn).
    assert len(fp8_saved) == 4
    assert {tuple(t.shape) for t in fp8_saved} == {(H, 16), (H, 2 * H), (2 * H, 16), (2 * H, H)}


def test_finite_amax_ignores_inf_and_nan() -> None:
    x = torch.tensor([1.0, -3.0, float("inf"), float("nan"), -float("inf")])
    assert finite_amax(x) == 3.0
    assert finite_amax(torch.tensor([float("nan")])) == 0.0
    assert finite_amax(torch.empty(0)) == 0.0


def test_cast_and_record_reference_path(seed: int) -> None:
    x = torch.randn(12, 20) * 4
    scale = torch.tensor([20.0])
    cell = torch.tensor([100.0])
    x_fp8, x_fp8_t = cast_and_record(x, scale, cell, torch.float8_e4m3fn, transpose=True)
    expected = quantize(x, scale, torch.float8_e4m3fn)
    assert torch.equal(x_fp8.view(torch.uint8), expected.view(torch.uint8))
    assert x_fp8_t.is_contiguous() and torch.equal(
        x_fp8_t.view(torch.uint8), expected.t().view(torch.uint8)
    )
    assert cell.item() == 100.0  # max-combined: the larger record stays
    cell.zero_()
    cast_and_record(x, scale, cell, torch.float8_e4m3fn, transpose=False)
    assert cell.item() == x.abs().max().item()
    assert not fused_kernel_available(x)  # CPU: the pure functions ran


@pytest.mark.parametrize("value", [1e6, -1e6])
def test_cast_saturates_instead_of_producing_nan(value: float) -> None:
    x = torch.full((2, 2), value)
    x_fp8, _ = cast_and_record(
        x, torch.tensor([1.0]), torch.zeros(1), torch.float8_e4m3fn, transpose=False
    )
    assert torch.equal(x_fp8.float(), torch.full((2, 2), 448.0 if value > 0 else -448.0))


@pytest.mark.parametrize(
    "capability,hip,fused",
    [
        ((7, 0), None, False),  # no FP8 type in Triton at all: compiling the cast would raise
        ((8, 0), None, False),
        ((8, 9), None, False),  # converts through float16 first: a second rounding
        ((9, 0), None, True),
        ((10, 0), None, True),
        ((9, 4), "6.2", False),  # ROCm converts its own way
    ],
)
def test_fused_cast_only_where_the_conversion_rounds_once(
    monkeypatch, capability, hip, fused
) -> None:
    """Which CUDA devices run the fused cast kernel, decided from the device alone."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    slot_cast.converts_in_one_rounding.cache_clear()
    try:
        assert slot_cast.converts_in_one_rounding(0) is fused
    finally:
        monkeypatch.undo()
        slot_cast.converts_in_one_rounding.cache_clear()
