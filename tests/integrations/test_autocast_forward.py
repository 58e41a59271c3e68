"""fp8state.autocast_forward: every call of a model under a new fp8_autocast, for loops that
call the model themselves (Trainer, Accelerate)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

import fp8state
from fp8state.errors import ConfigError
from fp8state.integrations.forward import autocast_forward, remove_autocast_forward


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = fp8state.Linear(16, 16)
        self.proj.fp8_min_gemm_macs = 0

    def forward(self, input_ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.proj(input_ids) * scale


def _fwd_amax(model: Model) -> torch.Tensor:
    return model.proj.fp8_meta("fwd").amax_history[0].clone()


def test_each_call_runs_in_fp8_and_updates_the_forward_scales() -> None:
    torch.manual_seed(0)
    model, twin = Model(), Model()
    twin.load_state_dict(model.state_dict())
    autocast_forward(model)
    x = torch.randn(4, 16)
    for _ in range(2):
        y = model(x, scale=2.0)
        with fp8state.fp8_autocast():
            y_twin = twin(x, scale=2.0)
        assert torch.equal(y, y_twin)
    assert model.proj.fp8_last_gemm_backend == "emulated"
    assert torch.equal(model.proj.fp8_meta("fwd").scale, twin.proj.fp8_meta("fwd").scale)
    assert not torch.equal(model.proj.fp8_meta("fwd").scale, torch.ones(3))


def test_the_recipe_and_backend_given_are_used() -> None:
    model = Model()
    recipe = fp8state.DelayedScaling(margin=1, amax_history_len=4)
    autocast_forward(model, fp8_recipe=recipe, gemm_backend="emulated")
    model(torch.full((4, 16), 3.0))
    # scale = fp8_max / amax / 2**margin, over the input slot's one recorded amax
    assert model.proj.fp8_meta("fwd").scale[0].item() == pytest.approx(448.0 / 3.0 / 2)


def test_signature_docstring_and_state_dict_are_the_models() -> None:
    model = Model()
    keys = list(model.state_dict())
    autocast_forward(model)
    assert list(inspect.signature(model.forward).parameters) == ["input_ids", "scale"]
    assert model.forward.__doc__ == Model.forward.__doc__
    assert list(model.state_dict()) == keys


def test_eval_runs_in_high_precision_when_asked() -> None:
    model = autocast_forward(Model(), during_eval=False).eval()
    x = torch.randn(4, 16)
    assert torch.equal(model(x), torch.nn.functional.linear(x, model.proj.weight, model.proj.bias))
    assert not _fwd_amax(model).any()
    model.train()
    model(x)
    assert _fwd_amax(model).any()


def test_a_deep_copy_calls_its_own_forward() -> None:
    model = autocast_forward(Model())
    clone = copy.deepcopy(model)
    assert clone.forward.__self__ is clone
    clone(torch.randn(4, 16))
    assert _fwd_amax(clone).any() and not _fwd_amax(model).any()


def test_remove_restores_the_forward_and_wrapping_twice_is_refused() -> None:
    model = autocast_forward(Model())
    with pytest.raises(ConfigError, match="remove_autocast_forward"):
        autocast_forward(model)
    remove_autocast_forward(model)
    assert "forward" not in model.__dict__
    model(torch.randn(4, 16))  # no autocast any more: nothing recorded
    assert not _fwd_amax(model).any()
    with pytest.raises(ConfigError, match="not wrapped"):
        remove_autocast_forward(model)


def test_an_instance_forward_set_by_another_wrapper_is_kept() -> None:
    model = Model()
    calls = []
    inner = model.forward

    def traced(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    model.forward = traced
    autocast_forward(model)
    model(torch.randn(4, 16))
    assert calls == [1] and _fwd_amax(model).any()
    remove_autocast_forward(model)
    assert model.forward is traced


def test_bad_arguments_are_refused_before_anything_changes() -> None:
    model = Model()
    with pytest.raises(ConfigError, match="gemm_backend"):
        autocast_forward(model, gemm_backend="fast")
    with pytest.raises(ConfigError, match="fp8_recipe"):
        autocast_forward(model, fp8_recipe="hybrid")  # type: ignore[arg-type]
    assert "forward" not in model.__dict__
