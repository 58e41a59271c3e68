"""Regression tests for bugs found in code review: backward scale updates after a failed
backward, the weight cache across a device move, pointer caches of a deep-copied module."""

from __future__ import annotations

import pytest
import torch

import fp8state
from fp8state import autocast

H = 16


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        raise RuntimeError("boom in backward")


def test_failed_backward_does_not_stop_later_backward_scale_updates(seed: int) -> None:
    layer = fp8state.Linear(H, H)
    x = torch.randn(4, H, requires_grad=True)
    with fp8state.fp8_autocast():
        y = layer(_Boom.apply(x))  # layer's backward runs (and registers) before _Boom raises
    with pytest.raises(RuntimeError, match="boom in backward"):
        y.sum().backward()
    # A normal step afterwards must update the backward scales when its backward finishes.
    with fp8state.fp8_autocast():
        y = layer(torch.randn(4, H, requires_grad=True))
    y.sum().backward()
    assert layer.fp8_meta("bwd").scale[0] != 1
    assert len(autocast._BACKWARD.pending) == 0


def test_weight_cache_does_not_outlive_a_device_move(seed: int) -> None:
    layer = fp8state.Linear(H, H)
    with fp8state.fp8_autocast():
        layer(torch.randn(4, H), is_first_microbatch=True)
    assert layer.fp8_weight_cache
    layer.to("meta")  # stands in for .cuda() / .to("cpu") on a machine without a second device
    cached = [t for entry in layer.fp8_weight_cache.values() for t in entry if t is not None]
    assert all(t.device == layer.weight.device for t in cached)


def test_deepcopied_module_counts_as_new_for_pointer_caches() -> None:
    # generation.py: a new module "may reuse a dead one's id()", so caches of buffer addresses
    # keyed by module ids must be rebuilt. deepcopy (EMA / reference models) and unpickling make
    # new modules without __init__, hence without init_fp8_meta's bump.
    import copy

    from fp8state._runtime import staging
    from fp8state._runtime.generation import buffer_generation

    model = torch.nn.Sequential(fp8state.Linear(H, H), fp8state.Linear(H, H))
    before = buffer_generation()
    clone = copy.deepcopy(model)
    assert buffer_generation() > before
    assert all(m in staging._LIVE for m in clone)  # staged with the others in state_dict()
