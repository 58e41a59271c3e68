"""The work an FP8 step queues, counted: casts, FP8 GEMMs and scale-update rounds per step.

Each cast and each FP8 GEMM is one kernel launch on a GPU (the fused Triton cast,
``torch._scaled_mm``), and each update round one batched launch per direction however many
modules ran (one collective across ranks). The host's time per step grows with these
counts, so they are pinned here, on the CPU, where the same functions run the emulation:
a change that adds a launch to the hot path fails this test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fp8state
import fp8state.autocast as autocast_mod
import fp8state.functional._slot as slot_mod
import fp8state.functional.linear as linear_mod
import fp8state.functional.mlp as mlp_mod
from fp8state._runtime import context_stack


@pytest.fixture
def count(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Calls of the functions that launch work, through to the real ones."""
    calls: Counter[str] = Counter()

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(slot_mod, "cast_slot", counted("cast", slot_mod.cast_slot))
    # A LayerNorm computed by its output's cast: still one cast of one operand.
    monkeypatch.setattr(
        slot_mod.norm_cast, "norm_cast_slot", counted("cast", slot_mod.norm_cast.norm_cast_slot)
    )
    monkeypatch.setattr(linear_mod, "fp8_gemm", counted("gemm", linear_mod.fp8_gemm))
    monkeypatch.setattr(mlp_mod, "fp8_gemm", counted("gemm", mlp_mod.fp8_gemm))
    # Forward updates at the context's exit, backward updates at the end of backward.
    for owner in (context_stack, autocast_mod):
        monkeypatch.setattr(owner, "reduce_and_update", counted("update", owner.reduce_and_update))
    return calls


def _step(model: nn.Module, x: torch.Tensor, **kwargs: Any) -> None:
    with fp8state.fp8_autocast():
        y = model(x, **kwargs)
    y.float().pow(2).mean().backward()


def _fp8(module: nn.Module) -> nn.Module:
    for m in module.modules():
        if isinstance(m, fp8state.FP8StateMixin):
            m.fp8_min_gemm_macs = 0
    return module


def test_a_linear_step_is_three_casts_three_gemms_two_updates(count: Counter[str]) -> None:
    layer = _fp8(fp8state.Linear(32, 32))
    x = torch.randn(8, 32, requires_grad=True)
    _step(layer, x)
    assert count == {"cast": 3, "gemm": 3, "update": 2}


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_a_layernorm_linear_step_is_a_linears_worth(
    count: Counter[str], normalization: str
) -> None:
    layer = _fp8(fp8state.LayerNormLinear(32, 32, normalization=normalization))
    x = torch.randn(8, 32, requires_grad=True)
    _step(layer, x)
    assert count == {"cast": 3, "gemm": 3, "update": 2}


def test_a_cached_weight_is_not_cast_again(count: Counter[str]) -> None:
    layer = _fp8(fp8state.Linear(32, 32))
    x = torch.randn(8, 32, requires_grad=True)
    _step(layer, x, is_first_microbatch=True)
    count.clear()
    _step(layer, x, is_first_microbatch=False)
    assert count == {"cast": 2, "gemm": 3, "update": 2}


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_a_layernorm_mlp_step_is_two_linears_worth(count: Counter[str], activation: str) -> None:
    # Six casts and six GEMMs whichever the activation (GELU is computed inside its cast).
    mlp = _fp8(fp8state.LayerNormMLP(32, 64, activation=activation))
    _step(mlp, torch.randn(8, 32, requires_grad=True))
    assert count == {"cast": 6, "gemm": 6, "update": 2}


def test_updates_do_not_grow_with_the_number_of_modules(count: Counter[str]) -> None:
    model = _fp8(nn.Sequential(*(fp8state.Linear(32, 32) for _ in range(10))))
    _step(model, torch.randn(8, 32, requires_grad=True))
    assert count == {"cast": 30, "gemm": 30, "update": 2}


def test_a_gemm_below_the_threshold_launches_no_fp8_work(count: Counter[str]) -> None:
    layer = fp8state.Linear(32, 32)
    layer.fp8_min_gemm_macs = 8 * 32 * 32 + 1  # the override: this GEMM is just below it
    _step(layer, torch.randn(8, 32, requires_grad=True))
    assert layer.fp8_last_gemm_backend == "high_precision"
    assert count == {}
