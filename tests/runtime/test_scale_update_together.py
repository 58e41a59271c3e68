"""Without Triton, a step's scale updates for several modules run as one set of ops on one
concatenation of their histories' windows: the same bits as each module's own update."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fp8state
from fp8state import scaling
from fp8state._runtime.amax_reduction import PendingSteps, reduce_and_update


def _modules() -> list[nn.Module]:
    torch.manual_seed(0)
    modules = [
        fp8state.Linear(16, 16),
        fp8state.LayerNormMLP(16, 32),  # two GEMMs: twice the slots
        fp8state.LayerNormLinear(16, 8),
        fp8state.Linear(16, 16),
    ]
    # A history longer than the step's window: only the window counts.
    modules[2].fp8_recipe = fp8state.DelayedScaling(amax_history_len=16)
    gen = torch.Generator().manual_seed(1)
    for module in modules:
        for direction in ("fwd", "bwd"):
            hist, scale, _ = module.fp8_meta(direction)
            hist.copy_(torch.rand(hist.shape, generator=gen) * 100)
            scale.copy_(torch.rand(scale.shape, generator=gen) + 0.5)
            # The edge cases of the update: amax 0, inf, NaN and tiny keep or cap the scale.
            hist[:, 0] = 0.0
            hist[1, -1] = float("inf") if direction == "fwd" else float("nan")
            hist[0, 1] = 1e-38
            module._fp8_continue_step(direction)  # mid-step, as after the step's records
    return modules


@pytest.mark.parametrize("algo,margin", [("max", 0), ("max", 3), ("most_recent", 1)])
def test_together_equals_module_by_module(monkeypatch, algo: str, margin: int) -> None:
    recipe = fp8state.DelayedScaling(amax_history_len=4, amax_compute_algo=algo, margin=margin)
    together = _modules()
    alone = copy.deepcopy(together)
    calls = []
    real = scaling.update_scale
    monkeypatch.setattr(
        scaling, "update_scale", lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    )
    for direction in ("fwd", "bwd"):
        pending = PendingSteps()
        for module in together:
            pending.add(module, recipe, None)
        reduce_and_update(direction, pending)
    assert len(calls) == 2  # one per direction, for all four modules
    for module in alone:
        for direction in ("fwd", "bwd"):
            module.fp8_update_scales(direction, recipe)
    for a, b in zip(together, alone, strict=True):
        assert a.fp8_recipe == recipe == b.fp8_recipe
        for direction in ("fwd", "bwd"):
            for x, y in zip(a.fp8_meta(direction), b.fp8_meta(direction), strict=True):
                assert torch.equal(x.view(torch.int32), y.view(torch.int32))  # bits: NaN too
            # The next record opens a new step, as after the module's own update.
            assert a._fp8_opens_step(direction) and b._fp8_opens_step(direction)


def test_a_longer_window_grows_the_histories_first() -> None:
    modules = [fp8state.Linear(16, 16), fp8state.Linear(16, 16)]
    recipe = fp8state.DelayedScaling(amax_history_len=2048)  # longer than the default 1024
    pending = PendingSteps()
    for module in modules:
        module.fp8_meta("fwd").amax_history[0].fill_(2.0)
        pending.add(module, recipe, None)
    with pytest.warns(UserWarning):
        reduce_and_update("fwd", pending)
    for module in modules:
        hist, scale, scale_inv = module.fp8_meta("fwd")
        assert hist.shape[0] == 2048 and module.fp8_recipe == recipe
        assert torch.equal(scale, torch.full_like(scale, 224.0))  # 448 / 2
        assert torch.equal(scale_inv, torch.reciprocal(scale))
