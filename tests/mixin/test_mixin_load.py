"""FP8StateMixin checkpoints: torch.save / torch.load(weights_only=True) round trips across
devices, strict loading, and checkpoints with a different number of history rows."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _helpers.models import FP8_BUFFERS, TwoGemm, make_model, mixin_modules, run_steps, save_load
from _helpers.state import assert_state_equal, fields

from fp8state.formats import Format
from fp8state.recipe import DelayedScaling

# ---------------------------------------------------------------- save / load round trip


def test_model_round_trip_through_torch_save_weights_only(tmp_path: Any, seed: int) -> None:
    model = make_model(3, hidden=4)
    model.blocks[1].fp8_update_scales(
        "fwd",
        DelayedScaling(
            margin=1, fp8_format=Format.E4M3, amax_history_len=7, amax_compute_algo="most_recent"
        ),
    )
    run_steps(model, 5, seed=seed)
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    sd = torch.load(path, weights_only=True)
    assert {k for k in sd if k.endswith("_extra_state")} == {
        f"blocks.{i}._extra_state" for i in range(3)
    }
    torch.manual_seed(seed + 1)
    fresh = make_model(3, hidden=4)
    fresh.load_state_dict(sd)
    assert_state_equal(fresh, model)
    assert fresh.blocks[1].fp8_recipe.amax_compute_algo == "most_recent"
    for (name, a), b in zip(fresh.state_dict().items(), model.state_dict().values(), strict=True):
        if not name.endswith("_extra_state"):
            assert torch.equal(a, b), name
    # Both continue identically: the step bookkeeping resumes the same way.
    run_steps(model, 2, seed=seed + 2)
    run_steps(fresh, 2, seed=seed + 2)
    assert_state_equal(fresh, model)


def test_round_trip_onto_device(device: torch.device) -> None:
    src = make_model(2)
    run_steps(src, 3)
    dst = make_model(2, device=device)
    sd = save_load(src.state_dict(), map_location=device)
    dst.load_state_dict(sd)
    assert {
        getattr(m, b).device.type for m in mixin_modules(dst).values() for b in FP8_BUFFERS
    } == {device.type}
    assert_state_equal(dst, src)


def test_payload_on_another_device_is_copied_to_the_modules(device: torch.device) -> None:
    src = TwoGemm()
    run_steps(src, 3)
    payload = src.get_extra_state().to(device)
    m = TwoGemm()  # on CPU
    buffers = {b: getattr(m, b) for b in FP8_BUFFERS}
    m.set_extra_state(payload)
    for name, buf in buffers.items():
        assert getattr(m, name) is buf and buf.device.type == "cpu"  # copied in place
    assert_state_equal(m, src)


def test_checkpointing_never_synchronizes_the_device(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.cuda.synchronize() called")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    src = make_model(2, device=device)
    run_steps(src, 2)
    dst = make_model(2, device=device)
    dst.load_state_dict(src.state_dict())
    assert_state_equal(dst, src)


def test_strict_load_reports_missing_extra_state() -> None:
    m = TwoGemm()
    sd = m.state_dict()
    del sd["_extra_state"]
    fresh = TwoGemm()
    with pytest.raises(RuntimeError, match="_extra_state"):
        fresh.load_state_dict(sd)
    result = fresh.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["_extra_state"]
    assert_state_equal(fresh, TwoGemm())  # FP8 metadata still the defaults


# ---------------------------------------------------------------- different history rows


@pytest.mark.parametrize(
    ("rows_ck", "rows_mod"),
    [
        pytest.param(8, 16, id="fewer-zero-pad"),
        pytest.param(32, 16, id="more-grow"),
        pytest.param(1, 1024, id="1-into-1024"),
    ],
)
@pytest.mark.parametrize("via", ["load_state_dict", "set_extra_state"])
def test_different_rows(rows_ck: int, rows_mod: int, via: str, device: torch.device) -> None:
    recipe = DelayedScaling(margin=1, amax_history_len=rows_ck, amax_compute_algo="most_recent")
    src = TwoGemm(history_rows=rows_ck, recipe=recipe)
    run_steps(src, rows_ck + 3)
    payload = src.get_extra_state()
    m = TwoGemm(history_rows=rows_mod, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if via == "load_state_dict":
            m.load_state_dict(save_load(src.state_dict()))
        else:
            m.set_extra_state(payload)
    assert len(caught) == 1, [str(w.message) for w in caught]
    msg = str(caught[0].message)
    assert str(rows_ck) in msg and str(rows_mod) in msg
    rows = max(rows_ck, rows_mod)
    assert m.fp8_recipe == recipe  # the recipe is the checkpoint's, window not adjusted
    for d in ("fwd", "bwd"):
        hist = getattr(m, f"fp8_{d}_amax_history")
        assert hist.device.type == device.type and hist.shape[0] == rows
        torch.testing.assert_close(
            hist[:rows_ck].cpu(), fields(payload)[f"{d}.amax_history"], atol=0, rtol=0
        )  # nothing dropped
        assert not hist[rows_ck:].any()  # zero-padded
        for f in ("scale", "scale_inv"):
            torch.testing.assert_close(
                getattr(m, f"fp8_{d}_{f}").cpu(), fields(payload)[f"{d}.{f}"], atol=0, rtol=0
            )
    assert set(FP8_BUFFERS) <= {n for n, _ in m.named_buffers()}
    assert "fp8_fwd_amax_history" not in m.state_dict()  # still non-persistent after growing
    # The module saves and reloads at its new length.
    again = TwoGemm(history_rows=rows)
    again.load_state_dict(save_load(m.state_dict()))
    assert_state_equal(again, m)


def test_same_rows_do_not_warn() -> None:
    src = TwoGemm()
    run_steps(src, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TwoGemm().load_state_dict(src.state_dict())
