"""FP8StateMixin construction: init_fp8_meta's buffers, devices and dtypes, argument checks, and
what get_extra_state returns."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from _helpers.corruptions import KEYS_V1
from _helpers.models import (
    FP8_BUFFERS,
    Bare,
    TwoGemm,
    make_model,
    mixin_modules,
    run_steps,
    save_load,
)
from _helpers.state import assert_state_equal, fields

import fp8state
from fp8state.errors import ConfigError
from fp8state.formats import Format
from fp8state.mixin import DEFAULT_HISTORY_ROWS
from fp8state.recipe import DelayedScaling

# ---------------------------------------------------------------- init_fp8_meta


@pytest.mark.parametrize("rows", [1, 16, None], ids=["rows1", "rows16", "rows-default"])
@pytest.mark.parametrize("gemms", [1, 2, 3], ids=["g1", "g2", "g3"])
def test_buffers_shapes_and_initial_values(gemms: int, rows: int | None) -> None:
    m = Bare(gemms) if rows is None else Bare(gemms, history_rows=rows)
    rows = DEFAULT_HISTORY_ROWS if rows is None else rows
    assert DEFAULT_HISTORY_ROWS == 1024
    expected = {
        "fp8_fwd_amax_history": torch.zeros(rows, 3 * gemms),
        "fp8_fwd_scale": torch.ones(3 * gemms),
        "fp8_fwd_scale_inv": torch.ones(3 * gemms),
        "fp8_bwd_amax_history": torch.zeros(rows, 2 * gemms),
        "fp8_bwd_scale": torch.ones(2 * gemms),
        "fp8_bwd_scale_inv": torch.ones(2 * gemms),
    }
    buffers = dict(m.named_buffers())
    assert buffers.keys() == expected.keys()
    for name, want in expected.items():
        torch.testing.assert_close(buffers[name], want, atol=0, rtol=0)
    assert m.fp8_num_gemms == gemms
    assert m.fp8_recipe == DelayedScaling(amax_history_len=min(1024, rows))
    meta = m.fp8_meta("fwd")
    assert meta.scale is m.fp8_fwd_scale and meta.amax_history is m.fp8_fwd_amax_history


def test_buffers_are_not_persistent() -> None:
    m = TwoGemm()
    assert set(FP8_BUFFERS) <= {n for n, _ in m.named_buffers()}
    assert set(m.state_dict()) == {"w1", "w2", "step_count", "_extra_state"}


def test_device_inferred_from_parameters(device: torch.device) -> None:
    m = TwoGemm(device=device)
    assert {getattr(m, b).device.type for b in FP8_BUFFERS} == {device.type}


def test_device_inferred_from_buffers_without_parameters(device: torch.device) -> None:
    class OnlyBuffer(fp8state.FP8StateMixin):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.zeros(1, device=device))
            self.init_fp8_meta(num_gemms=1)

    assert OnlyBuffer().fp8_fwd_scale.device.type == device.type


def test_device_defaults_to_cpu_and_explicit_device_wins() -> None:
    assert Bare().fp8_bwd_scale.device == torch.device("cpu")
    assert Bare(device="meta").fp8_bwd_scale.is_meta


def test_meta_device_module() -> None:
    with torch.device("meta"):
        m = TwoGemm()
    assert all(getattr(m, b).is_meta for b in FP8_BUFFERS)
    payload = m.get_extra_state()  # shapes only: there is no data to save
    assert payload.is_meta and payload.shape == TwoGemm().get_extra_state().shape


def test_to_moves_buffers(device: torch.device) -> None:
    m = TwoGemm()
    run_steps(m, 2)
    ref = TwoGemm()
    ref.load_state_dict(m.state_dict())
    m.to(device)
    assert {getattr(m, b).device.type for b in FP8_BUFFERS} == {device.type}
    assert_state_equal(m.to("cpu"), ref)


@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(lambda m: m.half(), id="half"),
        pytest.param(lambda m: m.bfloat16(), id="bfloat16"),
        pytest.param(lambda m: m.double(), id="double"),
        pytest.param(lambda m: m.to(torch.bfloat16), id="to-bf16"),
        pytest.param(lambda m: m.to("cpu", torch.float16), id="to-cpu-f16"),
    ],
)
def test_dtype_casts_keep_metadata_float32(convert: Any) -> None:
    m = TwoGemm()
    run_steps(m, 3)
    ref = TwoGemm()
    ref.load_state_dict(m.state_dict())
    convert(m)
    assert m.w1.dtype != torch.float32  # the parameters were converted ...
    assert_state_equal(m, ref)  # ... the FP8 metadata was not, bit for bit
    fresh = TwoGemm()
    fresh.load_state_dict(save_load(m.float().state_dict()))
    assert_state_equal(fresh, ref)


def test_to_empty_moves_buffers_and_load_restores() -> None:
    src = make_model(3)
    run_steps(src, 4)
    with torch.device("meta"):
        model = make_model(3)
    model.to_empty(device="cpu")
    for m in mixin_modules(model).values():
        assert {getattr(m, b).device.type for b in FP8_BUFFERS} == {"cpu"}
    model.load_state_dict(save_load(src.state_dict()))
    assert_state_equal(model, src)
    for (n, a), b in zip(model.named_parameters(), src.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_meta_module_load_materializes_on_payload_device() -> None:
    src = TwoGemm()
    run_steps(src, 2)
    with torch.device("meta"):
        m = TwoGemm()
    m.set_extra_state(src.get_extra_state())
    assert_state_equal(m, src)
    assert m.fp8_fwd_scale.device.type == "cpu"


CONFIG_ERRORS = [
    ("num_gemms-0", {"num_gemms": 0}),
    ("num_gemms-bool", {"num_gemms": True}),
    ("num_gemms-float", {"num_gemms": 1.0}),
    ("rows-0", {"num_gemms": 1, "history_rows": 0}),
    ("rows-neg", {"num_gemms": 1, "history_rows": -3}),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in CONFIG_ERRORS], ids=[c[0] for c in CONFIG_ERRORS])
def test_init_fp8_meta_rejects_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="init_fp8_meta"):
        Bare(**kwargs)


def test_init_fp8_meta_twice_and_not_at_all() -> None:
    m = Bare()
    with pytest.raises(ConfigError, match="second"):
        m.init_fp8_meta(num_gemms=1)

    class Forgot(fp8state.FP8StateMixin):
        pass

    with pytest.raises(ConfigError, match="init_fp8_meta"):
        Forgot().fp8_meta("fwd")
    with pytest.raises(ConfigError, match="init_fp8_meta"):
        Forgot().get_extra_state()


def test_init_recipe_window_longer_than_rows_grows_once() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = Bare(2, history_rows=8, recipe=DelayedScaling(amax_history_len=32))
    assert len(caught) == 1 and "8" in str(caught[0].message) and "32" in str(caught[0].message)
    assert m.fp8_fwd_amax_history.shape == (32, 6) and m.fp8_bwd_amax_history.shape == (32, 4)
    fresh = Bare(2, history_rows=32)
    fresh.load_state_dict(save_load(m.state_dict()))  # the payload it writes is loadable
    assert_state_equal(fresh, m)


# ---------------------------------------------------------------- get_extra_state


def test_get_extra_state_is_a_cpu_copy(device: torch.device) -> None:
    m = TwoGemm(device=device)
    run_steps(m, 3)
    packed = m.get_extra_state()
    assert type(packed) is torch.Tensor and packed.device.type == "cpu"
    live = {m.fp8_meta(d)[i].untyped_storage().data_ptr() for d in ("fwd", "bwd") for i in range(3)}
    assert packed.untyped_storage().data_ptr() not in live
    payload = fields(packed)
    assert set(payload) == KEYS_V1
    for d in ("fwd", "bwd"):
        for field in ("amax_history", "scale", "scale_inv"):
            torch.testing.assert_close(
                payload[f"{d}.{field}"], getattr(m, f"fp8_{d}_{field}").cpu(), atol=0, rtol=0
            )
    payload["fwd.scale"].fill_(7.0)  # writing the copy leaves the module alone
    assert not torch.equal(m.fp8_fwd_scale.cpu(), payload["fwd.scale"])


def test_get_extra_state_values() -> None:
    recipe = DelayedScaling(
        margin=2, fp8_format=Format.E4M3, amax_history_len=5, amax_compute_algo="most_recent"
    )
    p = fields(Bare(3, history_rows=9, recipe=recipe).get_extra_state())
    assert p["schema_version"].dtype == torch.int64 and p["schema_version"].dim() == 0
    assert p["schema_version"].item() == 2
    scalars = {k.removeprefix("recipe."): v.item() for k, v in p.items() if k.startswith("recipe.")}
    assert scalars == {"fp8_format": 0, "margin": 2, "amax_history_len": 5, "amax_compute_algo": 1}
    assert all(p[k].dtype == torch.int64 and p[k].dim() == 0 for k in p if k.startswith("recipe"))
    assert p["fwd.amax_history"].shape == (9, 9) and p["bwd.amax_history"].shape == (9, 6)


def test_history_growth_warning_points_at_the_assignment() -> None:
    import warnings

    import fp8state

    layer = fp8state.Linear(16, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer.fp8_recipe = fp8state.DelayedScaling(amax_history_len=2048)
    assert len(caught) == 1 and "grows from 1024 to 2048" in str(caught[0].message)
    assert caught[0].filename == __file__
