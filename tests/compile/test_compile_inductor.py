"""Inductor compiles fp8state's steps whole: no graph break, one compilation, eager's bounds.

Inductor fuses the norms and the emulated GEMMs' arithmetic, so its numbers are not eager's
bit for bit; the FP8 casts and their bookkeeping are fp8state's own operators, so every step
must still record its amaxes and update its scales (forward at the ``fp8_autocast`` exit,
backward at the end of backward) as an eager twin does, within tight bounds, with the
context outside the compiled function or inside it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import fp8state
from tests._helpers.numerics import sqnr

STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        fp8state.LayerNormLinear(32, 96), fp8state.Linear(96, 32), fp8state.LayerNormMLP(32, 64)
    )


def _outside(model: Callable, x: torch.Tensor) -> torch.Tensor:
    with fp8state.fp8_autocast():
        loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach()


def _inside(model: Callable, x: torch.Tensor) -> torch.Tensor:
    with fp8state.fp8_autocast():
        return model(x).pow(2).mean()


def _inside_step(step: Callable) -> Callable:
    def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = step(model, x)
        loss.backward()
        return loss.detach()

    return run


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_inductor_steps_track_eager_steps(where: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    twin = copy.deepcopy(model)
    if where == "outside":
        compiled = torch.compile(model, fullgraph=True)
        run, eager = (lambda m, x: _outside(compiled, x)), (lambda m, x: _outside(m, x))
    else:
        run = _inside_step(torch.compile(_inside, fullgraph=True))
        eager = _inside_step(_inside)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(64, 32, generator=gen)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            got = run(model, x)
        assert sqnr(eager(twin, x), got) > 40
    assert not counters["graph_break"]
    for m, t in zip(model, twin, strict=True):
        for direction in ("fwd", "bwd"):
            mine, theirs = m.fp8_meta(direction), t.fp8_meta(direction)
            # Every step recorded (a skipped step leaves a zero row) and updated the scales.
            assert bool(mine.amax_history[:STEPS].amax(dim=1).gt(0).all())
            torch.testing.assert_close(mine.amax_history, theirs.amax_history, rtol=1e-2, atol=0)
            torch.testing.assert_close(mine.scale, theirs.scale, rtol=1e-2, atol=0)
            assert torch.equal(mine.scale_inv, 1 / mine.scale)
