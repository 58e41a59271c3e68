"""fp8_autocast: nesting, restore on error, calibration, and when scales update."""

from __future__ import annotations

import pytest
import torch
from _helpers.state import fields

import fp8state
from fp8state import autocast
from fp8state._runtime import amax_reduction, context_stack
from fp8state.errors import ConfigError
from fp8state.recipe import DelayedScaling

H = 16


def _scale(module, d="fwd"):
    return module.fp8_meta(d).scale.clone()


def test_nesting_and_restore() -> None:
    assert not fp8state.is_fp8_enabled()
    with fp8state.fp8_autocast():
        assert fp8state.is_fp8_enabled()
        with fp8state.fp8_autocast(enabled=False):
            assert not fp8state.is_fp8_enabled()
        assert fp8state.is_fp8_enabled()
    assert not fp8state.is_fp8_enabled()


def test_restores_state_when_body_raises() -> None:
    layer = fp8state.Linear(H, H)
    with pytest.raises(RuntimeError, match="boom"), fp8state.fp8_autocast():
        with fp8state.fp8_autocast(enabled=False):
            raise RuntimeError("boom")
    assert not fp8state.is_fp8_enabled()
    assert autocast._THREAD.stack == [] and autocast._THREAD.fwd_pending is None
    # The library is usable afterwards: a new step records and updates normally.
    with fp8state.fp8_autocast():
        layer(torch.randn(4, H))
    assert layer.fp8_meta("fwd").scale[0] != 1


def test_same_instance_cannot_be_entered_twice() -> None:
    ctx = fp8state.fp8_autocast()
    with ctx, pytest.raises(ConfigError, match="entered twice"), ctx:
        pass
    with ctx:  # after exiting, the instance can be used again
        assert fp8state.is_fp8_enabled()


def test_each_context_runs_with_its_own_recipe_when_recipes_come_and_go() -> None:
    # A loop that builds a recipe per step: every step must scale with its own recipe's
    # margin, also once recipes are freed and new ones take their place (and their ids).
    layer = fp8state.Linear(H, H)
    x = torch.randn(4, H)
    for step in range(3 * autocast._BUILT_MAX):
        margin = step % 3
        recipe = DelayedScaling(margin=margin, amax_history_len=1)
        with fp8state.fp8_autocast(fp8_recipe=recipe):
            assert autocast.innermost_context().recipe is recipe
            layer(x)
        amax = layer.fp8_meta("fwd").amax_history[0, 0]
        expected = torch.tensor(448.0) / amax / 2**margin
        assert torch.equal(layer.fp8_meta("fwd").scale[0], expected)
        del recipe


@pytest.mark.skipif(
    not torch.distributed.is_available() or torch.distributed.is_initialized(),
    reason="needs torch.distributed, with no process group initialized yet",
)
def test_contexts_with_a_process_group_are_not_kept(tmp_path) -> None:
    # A context naming a group must not keep that group alive after the step.
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        kept_before = len(autocast._BUILT)
        with fp8state.fp8_autocast(fp8_group=group):
            assert autocast.innermost_context().group is group
        assert len(autocast._BUILT) == kept_before
        assert all(ctx.group is None for ctx in autocast._BUILT.values())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kwargs", [{"fp8_recipe": "hybrid"}, {"gemm_backend": "cublas"}], ids=["recipe", "backend"]
)
def test_bad_arguments(kwargs) -> None:
    with pytest.raises(ConfigError):
        fp8state.fp8_autocast(**kwargs)


def test_calibrating_records_but_computes_in_high_precision(seed: int) -> None:
    layer = fp8state.Linear(H, H)
    x = torch.randn(8, H, requires_grad=True)
    with fp8state.fp8_autocast(enabled=False, calibrating=True):
        y = layer(x)
    torch.testing.assert_close(
        y, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=0, rtol=0
    )
    fwd = layer.fp8_meta("fwd")
    assert (
        fwd.amax_history[0, 0] == x.abs().max()
        and fwd.amax_history[0, 1] == layer.weight.abs().max()
    )
    assert fwd.scale[0] == torch.tensor(448.0) / x.abs().max()  # one float32 division
    y.sum().backward()
    assert not layer.fp8_meta("bwd").amax_history.any()  # backward records nothing


def test_scales_update_only_when_outermost_context_exits(seed: int) -> None:
    layer = fp8state.Linear(H, H)
    with fp8state.fp8_autocast():
        with fp8state.fp8_autocast():
            layer(torch.randn(4, H))
        assert torch.equal(_scale(layer), torch.ones(3))
    assert _scale(layer)[0] != 1


def test_microbatches_in_one_step_keep_the_max(seed: int) -> None:
    recipe = DelayedScaling(amax_history_len=8)
    layer = fp8state.Linear(H, H)
    small, big = torch.full((2, H), 0.5), torch.full((2, H), 3.0)
    with fp8state.fp8_autocast(fp8_recipe=recipe):
        layer(small)
        layer(big)
        layer(small)
    hist = layer.fp8_meta("fwd").amax_history
    assert hist[0, 0] == 3.0 and not hist[1:].any()  # one row for the step, holding the max


def test_history_order_row0_is_most_recent_step(seed: int) -> None:
    recipe = DelayedScaling(
        amax_history_len=4,
        amax_compute_algo="most_recent",
        margin=1,
        fp8_format=fp8state.Format.E4M3,
    )
    layer = fp8state.Linear(H, H)
    for step in range(6):
        with fp8state.fp8_autocast(fp8_recipe=recipe):
            y = layer(torch.full((2, H), float(step + 1)))
        y.sum().backward()
    hist = layer.fp8_meta("fwd").amax_history
    assert hist[:6, 0].tolist() == [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    saved = fields(layer.get_extra_state())
    for d, fp8_max in (("fwd", 448.0), ("bwd", 448.0)):  # E4M3 both ways
        amax = saved[f"{d}.amax_history"][0]
        used = amax > 0
        expected = torch.full_like(amax, fp8_max) / amax / 2.0
        assert torch.equal(saved[f"{d}.scale"][used], expected[used])
        assert torch.equal(saved[f"{d}.scale_inv"][used], 1 / expected[used])


def test_backward_updates_once_per_pass_for_all_modules(monkeypatch, seed: int) -> None:
    calls = []
    real = amax_reduction.reduce_and_update

    def spy(direction, pending):
        calls.append((direction, len(pending)))
        real(direction, pending)

    monkeypatch.setattr(autocast, "reduce_and_update", spy)  # backward's
    monkeypatch.setattr(context_stack, "reduce_and_update", spy)  # the context exit's
    model = torch.nn.Sequential(
        fp8state.Linear(H, H), fp8state.LayerNormMLP(H, 32), fp8state.Linear(H, 4)
    )
    with fp8state.fp8_autocast():
        y = model(torch.randn(8, H))
    assert calls == [("fwd", 3)]
    bwd_before = [_scale(m, "bwd") for m in model]
    y.square().sum().backward()
    assert calls == [("fwd", 3), ("bwd", 3)]
    for m, before in zip(model, bwd_before, strict=True):
        assert not torch.equal(_scale(m, "bwd"), before)


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


def test_reduction_is_skipped_without_distributed() -> None:
    assert not amax_reduction.should_reduce(None)
