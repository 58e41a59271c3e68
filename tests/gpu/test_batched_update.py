"""On CUDA, a step's scale updates for many modules run as one launch: same bits as the pure
functions compute without Triton."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

import fp8state
from fp8state._runtime import amax_reduction, scale_update
from fp8state._runtime.amax_reduction import PendingSteps, reduce_and_update

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]


def _train(model: nn.Module, steps: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(steps):
        x = torch.randn(32, 64, device="cuda", generator=gen)
        with fp8state.fp8_autocast(fp8_recipe=fp8state.DelayedScaling(amax_history_len=8)):
            y = model(x)
        y.square().mean().backward()


def test_batched_step_equals_the_pure_functions(monkeypatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *(fp8state.Linear(64, 64, device="cuda") for _ in range(6)),
        fp8state.LayerNormMLP(64, 128, device="cuda"),
    )
    for m in model:
        m.fp8_min_gemm_macs = 0
    twin = copy.deepcopy(model)
    calls = []
    real = amax_reduction._update_batched
    monkeypatch.setattr(
        amax_reduction, "_update_batched", lambda *a: (calls.append(a[0]), real(*a))[1]
    )
    _train(model, 3)
    assert calls.count("fwd") == 3 and calls.count("bwd") == 3  # one launch per direction
    for owner in (amax_reduction, scale_update):  # the twin updates without Triton
        monkeypatch.setattr(owner, "kernels_available", lambda device: False)
    _train(twin, 3)
    for a, b in zip(model, twin, strict=True):
        for d in ("fwd", "bwd"):
            for x, y in zip(a.fp8_meta(d), b.fp8_meta(d), strict=True):
                assert torch.equal(x, y)


def test_pointer_table_is_rebuilt_after_buffers_move() -> None:
    modules = [fp8state.Linear(16, 16, device="cuda") for _ in range(3)]
    pending = PendingSteps()
    recipe = fp8state.DelayedScaling(amax_history_len=4)
    for m in modules:
        m.fp8_amax_cell("fwd", 0).fill_(2.0)
        pending.add(m, recipe, None)
    reduce_and_update("fwd", pending)
    for m in modules:
        m.to("cuda")  # same device: .to() may still hand back new tensors
        m.fp8_amax_cell("fwd", 0).fill_(4.0)
    reduce_and_update("fwd", pending)
    for m in modules:
        assert m.fp8_meta("fwd").scale[0].item() == 448.0 / 4.0
