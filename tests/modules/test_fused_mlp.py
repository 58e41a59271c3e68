"""LayerNormMLP's fused GELU path against its per-GEMM path (CPU, emulated FP8 GEMMs).

For float32 inputs the two must agree bit for bit: the same casts with the same slots, GELU and
its derivative computed in float32 either way. Only where the fused path quantizes GELU's
output straight from float32 (16-bit inputs) may they differ.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers.state import assert_state_equal

import fp8state
from fp8state.functional import mlp as _fp8_mlp


def _pair(bias: bool) -> tuple[fp8state.LayerNormMLP, fp8state.LayerNormMLP]:
    torch.manual_seed(0)
    fused = fp8state.LayerNormMLP(32, 64, bias=bias)
    unfused = copy.deepcopy(fused)
    unfused.fp8_fuse_activation = False
    return fused, unfused


def _steps(
    module: fp8state.LayerNormMLP, inputs: list[torch.Tensor], grad_input: bool, **kwargs
) -> list[tuple[torch.Tensor, ...]]:
    results = []
    for i, x in enumerate(inputs):
        x = x.clone().requires_grad_(grad_input)
        with fp8state.fp8_autocast(fp8_recipe=fp8state.DelayedScaling(amax_history_len=4)):
            y = module(x, **kwargs) if not kwargs else module(x, is_first_microbatch=(i % 2 == 0))
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        grads = [p.grad.clone() for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        results.append((y.detach(), x.grad if grad_input else torch.zeros(()), *grads))
    return results


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("grad_input", [True, False])
@pytest.mark.parametrize("shape", [(8, 32), (2, 5, 32)])
@pytest.mark.parametrize("microbatches", [False, True])
def test_fused_equals_unfused_bitwise_in_float32(bias, grad_input, shape, microbatches) -> None:
    fused, unfused = _pair(bias)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(*shape, generator=gen) * (i + 1) for i in range(3)]
    kwargs = {"is_first_microbatch": True} if microbatches else {}
    got = _steps(fused, inputs, grad_input, **kwargs)
    want = _steps(unfused, inputs, grad_input, **kwargs)
    for got_step, want_step in zip(got, want, strict=True):
        for a, b in zip(got_step, want_step, strict=True):
            assert torch.equal(a, b)
    assert_state_equal(fused, unfused)
    assert fused.fp8_last_gemm_backend == "emulated"


def test_fused_path_runs_only_where_it_applies(monkeypatch) -> None:
    calls = []
    original = _fp8_mlp._FP8GeluMLP.apply
    monkeypatch.setattr(_fp8_mlp._FP8GeluMLP, "apply", lambda *a: calls.append(1) or original(*a))
    mlp = fp8state.LayerNormMLP(32, 64)
    x = torch.randn(4, 32)
    with fp8state.fp8_autocast():
        mlp(x)
    assert calls == [1]
    with fp8state.fp8_autocast(enabled=False, calibrating=True):
        mlp(x)  # calibrating: per-GEMM path, high precision
    with fp8state.fp8_autocast(enabled=False):
        mlp(x)
    mlp.fp8_min_gemm_macs = 10**9  # below the threshold: per-GEMM fallback
    with fp8state.fp8_autocast():
        mlp(x)
    assert mlp.fp8_last_gemm_backend == "high_precision"
    relu = fp8state.LayerNormMLP(32, 64, activation="relu")
    with fp8state.fp8_autocast():
        relu(x)
    assert calls == [1]


def test_bfloat16_fused_close_to_unfused() -> None:
    """16-bit inputs: GELU's output is quantized from float32 instead of its bf16 rounding."""
    fused, unfused = _pair(True)
    fused, unfused = fused.to(torch.bfloat16), unfused.to(torch.bfloat16)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = _steps(fused, [x], True)[0]
    want = _steps(unfused, [x], True)[0]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.1, atol=0.05)


def test_second_backward_through_fused_graph_is_a_clear_error() -> None:
    mlp = fp8state.LayerNormMLP(32, 64)
    with fp8state.fp8_autocast():
        y = mlp(torch.randn(4, 32)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(fp8state.errors.ConfigError, match="fp8_fuse_activation = False"):
        y.backward()


def test_intermediates_are_released_by_backward() -> None:
    """Nothing of the forward outlives backward (ctx drops its references)."""
    import gc
    import weakref

    mlp = fp8state.LayerNormMLP(32, 64)
    with fp8state.fp8_autocast():
        y = mlp(torch.randn(4, 32))
    node = y.grad_fn
    refs = [weakref.ref(t) for t in node.tensors if t is not None]
    y.sum().backward()
    del y, node
    gc.collect()
    assert refs and all(r() is None for r in refs)
