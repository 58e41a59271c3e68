"""Compiled calls with ``is_first_microbatch``: the eager path's FP8 weight cache, eager's numbers.

A step of several micro-batches casts each FP8 weight once (``is_first_microbatch=True``) and
reuses the copy in the later ones (False), recording no weight amax there. Compiled, the same
loop must compute what eager computes, bit for bit with ``aot_eager`` (outputs, gradients,
every FP8 buffer, the modules' caches), with one graph per value of the argument and no
recompilation after them. With Inductor, the graphs get copies of the cached tensors (an
operator's outputs are the graph's to reuse), and the cache must still hold what eager's holds
after the later graphs ran.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch._dynamo.testing
from _helpers.numerics import sqnr
from _helpers.state import assert_same, assert_state_equal
from torch import nn

import fp8state
from fp8state.slots import FwdSlot, fwd_slot

MICRO_BATCHES = 3
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        fp8state.LayerNormLinear(32, 48), fp8state.Linear(48, 32), fp8state.LayerNormMLP(32, 64)
    )


class _Block(nn.Module):
    """Passes ``is_first_microbatch`` on to each FP8 module, as Megatron-style blocks do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = _model()

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, is_first_microbatch=is_first_microbatch)
        return x


def _inputs() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        [torch.randn(2, 8, 32, generator=gen) * (m + 1) for m in range(MICRO_BATCHES)]
        for _ in range(STEPS)
    ]


def _train(
    block: nn.Module, forward: Callable[..., torch.Tensor], compiled: bool
) -> list[torch.Tensor]:
    """Steps of micro-batches, an ``fp8_autocast`` and a backward each, SGD between steps."""
    losses = []
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
    for step, micro_batches in enumerate(_inputs()):
        for m, x in enumerate(micro_batches):
            # Two graphs (True, then False) in the first step; none compiled after them.
            with torch._dynamo.config.patch(error_on_recompile=compiled and step > 0):
                with fp8state.fp8_autocast():
                    loss = forward(x, is_first_microbatch=m == 0).pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()  # the weights change: the next step's first micro-batch casts again
        optimizer.zero_grad()
    return losses


def _twins() -> tuple[nn.Module, nn.Module]:
    block = _Block()
    return block, copy.deepcopy(block)


def test_compiled_micro_batches_reuse_cached_weights_as_eager() -> None:
    block, twin = _twins()
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    got = _train(block, compiled, compiled=True)
    want = _train(twin, twin, compiled=False)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert counter.frame_count == 2  # one graph per value of is_first_microbatch
    assert_state_equal(block, twin)
    for a, b in zip(block.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(block.layers, twin.layers, strict=True):
        assert a.fp8_weight_cache
        assert_same(a.fp8_weight_cache, b.fp8_weight_cache)
    # A later micro-batch records no weight amax. One history row per fp8_autocast, newest
    # first: in every step, the rows of the later micro-batches hold zero in the weight's slot.
    history = block.layers[1].fp8_meta("fwd").amax_history
    weights = history[: STEPS * MICRO_BATCHES, fwd_slot(0, FwdSlot.WEIGHT)]
    first = torch.arange(STEPS * MICRO_BATCHES) % MICRO_BATCHES == MICRO_BATCHES - 1
    assert bool(weights[first].gt(0).all()) and weights[~first].count_nonzero() == 0


def test_a_later_micro_batch_without_a_cached_weight_casts_and_keeps_it() -> None:
    # As eagerly: False with an empty cache (after a load emptied it) casts, records and keeps.
    block, twin = _twins()
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = _inputs()[0][0]
    for forward, module in ((compiled, block), (twin, twin)):
        with fp8state.fp8_autocast():
            forward(x, is_first_microbatch=False).sum().backward()
        assert all(layer.fp8_weight_cache for layer in module.layers)
    assert_state_equal(block, twin)


def test_inductor_steps_keep_the_cache_eager_keeps() -> None:
    # Inductor's numbers are eager's within bounds (it fuses the norms), but the cached FP8
    # weights are cast from the same weights with the same first scales: after every graph,
    # the cache holds eager's bytes.
    block, twin = _twins()
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    for m, x in enumerate(_inputs()[0]):
        outs = []
        for forward in (compiled, twin):
            with fp8state.fp8_autocast():
                outs.append(forward(x, is_first_microbatch=m == 0))
            outs[-1].pow(2).mean().backward()
        assert sqnr(outs[1], outs[0]) > 40
        for a, b in zip(block.layers, twin.layers, strict=True):
            assert_same(a.fp8_weight_cache, b.fp8_weight_cache, where=f"micro-batch {m}")


@pytest.mark.parametrize("first", [True, False])
def test_fallbacks_and_calibration_take_is_first_microbatch_as_eager(first: bool) -> None:
    # Below the FP8 threshold, or calibrating, the argument changes nothing (eagerly too).
    block, twin = _twins()
    for module in (*block.layers, *twin.layers):
        module.fp8_min_gemm_macs = 10**9
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = _inputs()[0][0]
    for settings in ({}, {"enabled": False, "calibrating": True}):
        for forward in (compiled, twin):
            with fp8state.fp8_autocast(**settings):
                forward(x, is_first_microbatch=first).sum().backward()
        assert_state_equal(block, twin)
    assert not any(layer.fp8_weight_cache for layer in block.layers)
