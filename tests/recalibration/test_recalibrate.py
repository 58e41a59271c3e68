"""``fp8state.recalibrate``: scales from a few batches, exact, and nothing else changes."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from _helpers.state import assert_same, assert_state_equal, fields, fp8_payloads
from torch import nn

import fp8state
from fp8state.errors import ConfigError

H, FFN, OUT = 16, 32, 4
E4M3_MAX, E5M2_MAX = torch.tensor(448.0), torch.tensor(57344.0)


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        fp8state.Linear(H, H), fp8state.LayerNormMLP(H, FFN), fp8state.Linear(H, OUT)
    )


def _batches(n: int, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(8, H, generator=gen) * scale * (i + 1) for i in range(n)]


def _train(model: nn.Module, steps: int, scale: float, recipe: fp8state.DelayedScaling) -> None:
    """A few FP8 steps on large inputs: histories full of amaxes calibration must replace."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for x in _batches(steps, seed=99, scale=scale):
        with fp8state.fp8_autocast(fp8_recipe=recipe):
            loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _expected_fwd_amaxes(
    model: nn.Sequential, batches: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Input and weight amax per forward slot, from plain torch ops (output slots: 0)."""
    lin0, mlp, head = model
    amax = {"0": torch.zeros(3), "1": torch.zeros(6), "2": torch.zeros(3)}
    with torch.no_grad():
        for x in batches:
            h0 = F.linear(x, lin0.weight, lin0.bias)
            normed = F.layer_norm(h0, (H,), mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.eps)
            act = F.gelu(F.linear(normed, mlp.fc1_weight, mlp.fc1_bias), approximate="tanh")
            h1 = F.linear(act, mlp.fc2_weight, mlp.fc2_bias)
            seen = {
                "0": [x, lin0.weight],
                "1": [normed, mlp.fc1_weight, None, act, mlp.fc2_weight],
                "2": [h1, head.weight],
            }
            for name, tensors in seen.items():
                for slot, t in enumerate(tensors):
                    if t is not None:
                        amax[name][slot] = torch.maximum(amax[name][slot], t.abs().max())
    return amax


@pytest.mark.parametrize("margin", [0, 3])
def test_forward_scales_are_fp8_max_over_batch_amax(margin: int) -> None:
    model = _model()
    _train(model, 3, scale=50.0, recipe=fp8state.DelayedScaling(amax_history_len=16))
    batches = _batches(4, seed=1)
    recipe = fp8state.DelayedScaling(margin=margin, amax_history_len=16)
    report = fp8state.recalibrate(model, batches, fp8_recipe=recipe)

    assert report.batches == 4 and report.modules == ("0", "1", "2") and not report.skipped
    assert report.recipe == recipe and not report.backward
    for name, amax in _expected_fwd_amaxes(model, batches).items():
        meta = model.get_submodule(name).fp8_meta("fwd")
        recorded = amax > 0
        expected = E4M3_MAX / amax[recorded] / 2.0**margin
        assert torch.equal(meta.scale[recorded], expected), name
        assert torch.equal(meta.scale_inv, torch.reciprocal(meta.scale))
        assert torch.equal(meta.scale[~recorded], torch.ones(int((~recorded).sum())))  # outputs
        # reset: one row, the max over all batches; the stale training rows are gone.
        assert torch.equal(meta.amax_history[0], amax)
        assert not meta.amax_history[1:].any()
        assert model.get_submodule(name).fp8_recipe == recipe


def test_window_and_algorithm_do_not_change_the_result() -> None:
    batches = _batches(5, seed=2)
    results = []
    for recipe in (
        fp8state.DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent"),
        fp8state.DelayedScaling(amax_history_len=64),
    ):
        model = _model()
        fp8state.recalibrate(model, batches, fp8_recipe=recipe)
        results.append(model[0].fp8_meta("fwd").scale.clone())
    # Batch i is scaled by i + 1: "most_recent" over one row per batch would see only the last.
    assert torch.equal(results[0], results[1])
    assert results[0][0] == E4M3_MAX / max(b.abs().max() for b in batches)


def test_reset_false_keeps_older_rows_in_the_window() -> None:
    model = _model()
    recipe = fp8state.DelayedScaling(amax_history_len=16)
    _train(model, 3, scale=50.0, recipe=recipe)
    old = model[0].fp8_meta("fwd").amax_history[:3].clone()
    batches = _batches(2, seed=3)
    fp8state.recalibrate(model, batches, reset=False)
    hist = model[0].fp8_meta("fwd").amax_history
    assert torch.equal(hist[1:4], old)  # pushed down one row, nothing lost
    assert hist[0, 0] == max(b.abs().max() for b in batches)
    assert torch.equal(model[0].fp8_meta("fwd").scale[0], E4M3_MAX / hist[:16, 0].max())


def test_backward_history_is_kept_and_its_scales_follow_the_new_recipe() -> None:
    model = _model()
    _train(model, 3, scale=1.0, recipe=fp8state.DelayedScaling(amax_history_len=16))
    bwd_before = model[2].fp8_meta("bwd").amax_history.clone()
    new = fp8state.DelayedScaling(margin=2, fp8_format=fp8state.Format.E4M3, amax_history_len=2)
    fp8state.recalibrate(model, _batches(2, seed=4), fp8_recipe=new)
    bwd = model[2].fp8_meta("bwd")
    assert torch.equal(bwd.amax_history, bwd_before)  # forward-only: gradients unseen
    amax = bwd_before[:2].amax(dim=0)
    assert torch.equal(bwd.scale[0], E4M3_MAX / amax[0] / 4.0)
    assert bwd.scale[1] == 1.0  # grad_input slot: never recorded, scale kept
    # What a checkpoint saves is consistent with the recipe it saves.
    payload = fields(model[2].get_extra_state())
    assert payload["recipe.margin"] == 2 and payload["recipe.fp8_format"] == 0
    assert torch.equal(payload["bwd.scale"], bwd.scale)


def test_loss_fn_calibrates_backward_exactly_and_leaves_grads_alone() -> None:
    torch.manual_seed(0)
    layer = fp8state.Linear(H, OUT)
    gen = torch.Generator().manual_seed(5)
    # loss = sum(out * g): the gradient reaching the GEMM's output is exactly g.
    batches = [
        (torch.randn(8, H, generator=gen), torch.randn(8, OUT, generator=gen) * (i + 1))
        for i in range(3)
    ]
    sentinel = [torch.full_like(p, 7.0) for p in layer.parameters()]
    for p, g in zip(layer.parameters(), sentinel, strict=True):
        p.grad = g
    weights = [p.detach().clone() for p in layer.parameters()]
    forward_only = copy.deepcopy(layer)

    report = fp8state.recalibrate(
        layer, batches, forward_fn=lambda m, b: m(b[0]), loss_fn=lambda out, b: (out * b[1]).sum()
    )
    fp8state.recalibrate(forward_only, batches, forward_fn=lambda m, b: m(b[0]))

    assert report.backward and report.batches == 3
    bwd = layer.fp8_meta("bwd")
    grad_amax = max(g.abs().max() for _, g in batches)
    assert bwd.amax_history[0, 0] == grad_amax and not bwd.amax_history[1:].any()
    assert torch.equal(bwd.scale[0], E5M2_MAX / grad_amax)
    # Forward metadata: exactly what forward-only calibration gives (FP8 passes undone).
    for field in ("amax_history", "scale", "scale_inv"):
        assert torch.equal(
            getattr(layer.fp8_meta("fwd"), field), getattr(forward_only.fp8_meta("fwd"), field)
        )
    for p, g, w in zip(layer.parameters(), sentinel, weights, strict=True):
        assert p.grad is g and bool((g == 7.0).all())
        assert torch.equal(p.detach(), w)


def test_loss_fn_on_a_deep_model_records_every_gradient_slot() -> None:
    model = _model()
    fp8state.recalibrate(model, _batches(3, seed=6), loss_fn=lambda out, b: out.square().mean())
    for name, slots in (("0", [0]), ("1", [0, 2]), ("2", [0])):
        bwd = model.get_submodule(name).fp8_meta("bwd")
        assert (bwd.amax_history[0, slots] > 0).all() and not bwd.amax_history[1:].any()
        assert torch.equal(bwd.scale[slots], E5M2_MAX / bwd.amax_history[0, slots])


class _Mixed(nn.Module):
    """BatchNorm, dropout and an eval-mode submodule around FP8 layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = fp8state.Linear(H, H)
        self.norm = nn.BatchNorm1d(H)
        self.drop = nn.Dropout(0.5)
        self.frozen_norm = nn.BatchNorm1d(H)
        self.head = fp8state.Linear(H, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen_norm(self.drop(self.norm(self.inp(x)))))


@pytest.mark.parametrize("training", [None, True, False])
def test_only_fp8_metadata_changes(training: bool | None) -> None:
    torch.manual_seed(0)
    model = _Mixed()
    model.frozen_norm.eval()  # a mixed-mode model: flags are restored one by one
    params = {k: v.clone() for k, v in model.state_dict().items() if "_extra_state" not in k}
    rng = torch.get_rng_state()
    before = fp8_payloads(model)
    fp8state.recalibrate(
        model, _batches(3, seed=7), training=training, loss_fn=lambda out, b: out.square().mean()
    )
    after_sd = model.state_dict()
    for key, value in params.items():
        assert torch.equal(after_sd[key], value), key  # weights and BatchNorm statistics
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and model.norm.training and not model.frozen_norm.training
    assert not torch.equal(
        before["inp"]["fwd.scale"], fields(model.inp.get_extra_state())["fwd.scale"]
    )


def test_batches_as_tuples_dicts_and_forward_fn() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = fp8state.Linear(H, OUT)
            self.b = fp8state.Linear(H, OUT)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(y)

    x, y = _batches(2, seed=8)
    for batches, fn in (
        ([(x, y)], None),
        ([{"x": x, "y": y}], None),
        ([{"data": (x, y)}], lambda m, b: m(*b["data"])),
    ):
        model = TwoInputs()
        fp8state.recalibrate(model, batches, forward_fn=fn)
        assert model.a.fp8_meta("fwd").amax_history[0, 0] == x.abs().max()
        assert model.b.fp8_meta("fwd").amax_history[0, 0] == y.abs().max()


def test_num_batches_takes_the_first_ones_of_an_endless_stream() -> None:
    model = _model()
    stream = (torch.full((2, H), float(i + 1)) for i in itertools.count())
    report = fp8state.recalibrate(model, stream, num_batches=3)
    assert report.batches == 3
    assert model[0].fp8_meta("fwd").amax_history[0, 0] == 3.0


def test_modules_that_do_not_run_keep_their_metadata_and_are_reported() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = fp8state.Linear(H, OUT)
            self.unused = fp8state.Linear(H, OUT)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = Branchy()
    _train(model.unused, 2, scale=3.0, recipe=fp8state.DelayedScaling(amax_history_len=8))
    before = fp8_payloads(model)["unused"]
    with pytest.warns(UserWarning, match=r"1 FP8 module\(s\) did not run.*unused"):
        report = fp8state.recalibrate(
            model, _batches(1, seed=9), fp8_recipe=fp8state.DelayedScaling(margin=1)
        )
    assert report.modules == ("used",) and report.skipped == ("unused",)
    assert_same(before, fp8_payloads(model)["unused"])


def test_checkpoint_after_recalibration_holds_the_new_scales() -> None:
    model = _model()
    _ = model.state_dict()  # stage once before: the staged copy must not be handed out later
    fp8state.recalibrate(model, _batches(2, seed=10))
    fresh = _model(seed=1)
    fresh.load_state_dict(model.state_dict())
    assert_state_equal(model, fresh)


def test_a_model_without_fp8_modules_is_an_error() -> None:
    with pytest.raises(
        ConfigError, match=r"recalibrate\(model=Sequential\).*no FP8 module"
    ) as caught:
        fp8state.recalibrate(nn.Sequential(nn.Linear(H, H)), _batches(1, seed=0))
    assert "fp8state.convert_model(model)" in caught.value.fix
    assert "fp8state.plan_conversion(model)" in caught.value.fix


class _OneInput(nn.Module):
    """``forward(x)``: a model a DataLoader of ``(input, target)`` pairs does not fit."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = fp8state.Linear(H, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_input_target_pairs_from_a_dataloader_name_forward_fn() -> None:
    x, y = torch.randn(8, H), torch.randn(8, OUT)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model = _OneInput()
    _train(model, 2, scale=5.0, recipe=fp8state.DelayedScaling(amax_history_len=16))
    before = fp8_payloads(model)
    with pytest.raises(ConfigError) as caught:
        fp8state.recalibrate(model, loader)
    err = caught.value
    assert err.key == "recalibrate(batches=...)"
    assert "_OneInput.forward" in err.found and "list of 2 items as model(*batch)" in err.found
    assert "takes 2 positional arguments but 3 were given" in err.found
    assert "forward_fn=lambda model, batch: model(batch[0])" in err.fix
    assert isinstance(err.__cause__, TypeError)
    assert_same(before, fp8_payloads(model))
    # The fix the message gives works on the same loader.
    report = fp8state.recalibrate(model, loader, forward_fn=lambda m, b: m(b[0]))
    assert report.batches == 2 and model.lin.fp8_meta("fwd").amax_history[0, 0] == x.abs().max()


def test_a_dict_batch_the_model_cannot_take_names_its_keys() -> None:
    model = _OneInput()
    before = fp8_payloads(model)
    batch = {"input": torch.randn(2, H), "label": torch.randn(2, OUT)}
    with pytest.raises(
        ConfigError,
        match=r"dict with keys \['input', 'label'\] as "
        r"model\(\*\*batch\)",
    ) as caught:
        fp8state.recalibrate(model, [batch], loss_fn=lambda out, b: out.sum())
    assert "model(batch['input'])" in caught.value.fix
    assert isinstance(caught.value.__cause__, TypeError)
    assert_same(before, fp8_payloads(model))


def test_a_type_error_for_a_single_tensor_batch_is_the_model_s_own() -> None:
    class Broken(_OneInput):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise TypeError("a bug inside the model")

    model = Broken()
    before = fp8_payloads(model)
    with pytest.raises(TypeError, match="a bug inside the model") as caught:
        fp8state.recalibrate(model, _batches(1, seed=0))
    assert not isinstance(caught.value, ConfigError)
    assert_same(before, fp8_payloads(model))


@pytest.mark.parametrize("batches", [[], iter(()), (b for b in [])], ids=["list", "iter", "gen"])
def test_no_batch_is_an_error_and_changes_nothing(batches) -> None:
    model = _model()
    _train(model, 2, scale=5.0, recipe=fp8state.DelayedScaling(amax_history_len=16))
    before = fp8_payloads(model)
    with pytest.raises(ConfigError, match="no batch"):
        fp8state.recalibrate(model, batches)
    assert_same(before, fp8_payloads(model))


def _raise_on_third(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if batch[0, 0] == 3.0:
        raise RuntimeError("bad batch")
    return model(batch)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batches": [1, 2]}, ConfigError, "a batch of type int"),
        ({"forward_fn": _raise_on_third}, RuntimeError, "bad batch"),
        ({"loss_fn": lambda out, b: out}, ConfigError, r"loss_fn=.*shape \(2, 4\)"),
        ({"loss_fn": lambda out, b: out.detach().sum()}, ConfigError, "requires_grad=False"),
    ],
    ids=["batch-type", "forward-raises", "loss-not-scalar", "loss-no-grad"],
)
def test_failures_part_way_restore_the_metadata(kwargs, error, match) -> None:
    model = _model()
    _train(model, 2, scale=5.0, recipe=fp8state.DelayedScaling(amax_history_len=16))
    before = fp8_payloads(model)
    args = {"batches": [torch.full((2, H), float(i + 1)) for i in range(4)], **kwargs}
    with pytest.raises(error, match=match):
        fp8state.recalibrate(model, args.pop("batches"), **args)
    assert_same(before, fp8_payloads(model))
    assert model.training


def test_argument_errors() -> None:
    model = _model()
    x = _batches(1, seed=0)
    cases = [
        (lambda: fp8state.recalibrate(model, x[0]), r"batches=.*Tensor"),
        (lambda: fp8state.recalibrate(model, x, num_batches=0), r"num_batches=.*0"),
        (lambda: fp8state.recalibrate(model, x, fp8_recipe="max"), r"fp8_recipe=.*str"),
        (lambda: fp8state.recalibrate("model", x), r"model=.*str"),  # type: ignore[arg-type]
        (lambda: fp8state.recalibrate(model, x, loss_fn=3), r"loss_fn=.*int"),
    ]
    for call, match in cases:
        with pytest.raises(ConfigError, match=match):
            call()


def test_frozen_model_with_loss_fn_is_an_error() -> None:
    model = _model().requires_grad_(False)
    with pytest.raises(ConfigError, match="no parameter that requires grad"):
        fp8state.recalibrate(model, _batches(1, seed=0), loss_fn=lambda o, b: o.sum())


def test_inside_fp8_autocast_is_an_error() -> None:
    model = _model()
    with fp8state.fp8_autocast(enabled=False), pytest.raises(ConfigError, match="inside"):
        fp8state.recalibrate(model, _batches(1, seed=0))


def test_modules_with_different_recipes_need_an_explicit_recipe() -> None:
    model = _model()
    model[1].fp8_recipe = fp8state.DelayedScaling(margin=1)
    with pytest.raises(ConfigError, match="2 different recipes"):
        fp8state.recalibrate(model, _batches(1, seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = fp8state.recalibrate(
            model, _batches(1, seed=0), fp8_recipe=fp8state.DelayedScaling()
        )
    assert all(m.fp8_recipe == report.recipe for m in model)
