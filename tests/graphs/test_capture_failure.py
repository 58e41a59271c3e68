"""A capture that fails leaves its modules as they were: FP8 metadata, recipe, weight caches
and the graphed flag. On the CPU every capture fails (at its first CUDA call), after the
modules were prepared for it; the GPU tests capture for real."""

from __future__ import annotations

import pytest
import torch

import fp8state
from fp8state.autocast import FP8Context
from fp8state.graphs._capture import capture_all

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="needs the capture to fail")


@CPU_ONLY
@pytest.mark.parametrize("weight_caching", [False, True])
def test_a_failed_capture_puts_the_modules_back(weight_caching: bool) -> None:
    torch.manual_seed(0)
    own = fp8state.DelayedScaling(amax_history_len=8)
    layer = fp8state.Linear(32, 32)
    layer.fp8_min_gemm_macs = 0
    x = torch.randn(8, 32)
    for step in range(3):
        with fp8state.fp8_autocast(fp8_recipe=own):
            layer(x * (step + 1), is_first_microbatch=step == 0 or None)
    cache = dict(layer.fp8_weight_cache)
    assert cache  # the first step's FP8 weight, kept for later micro-batches
    history = layer.fp8_meta("fwd").amax_history.clone()
    scale = layer.fp8_meta("fwd").scale.clone()
    longer = fp8state.DelayedScaling(amax_history_len=32)  # the graphs' window grows buffers
    ctx = FP8Context(
        enabled=True, calibrating=False, recipe=longer, group=None, gemm_backend="auto"
    )
    with pytest.raises((RuntimeError, AssertionError)):
        capture_all([layer.forward], [layer], [(x,)], ctx, 1, False, None, weight_caching)
    assert layer.fp8_recipe is own and layer.fp8_graphed is False
    assert layer.fp8_weight_cache == cache
    assert all(a is b for a, b in zip(layer.fp8_weight_cache[0], cache[0], strict=True))
    grown = layer.fp8_meta("fwd").amax_history
    assert grown.shape[0] >= 32  # a shorter window fits the grown buffer
    assert torch.equal(grown[: history.shape[0]], history) and not grown[history.shape[0] :].any()
    assert torch.equal(layer.fp8_meta("fwd").scale, scale)
