"""FP8StateMixin: buffers and devices, delayed-scaling bookkeeping, and checkpoints (save with
torch.save, read with weights_only=True, validate before touching anything)."""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
from _utils import (
    CORRUPTIONS,
    FP8_BUFFERS,
    KEYS_V1,
    Mutation,
    TwoGemm,
    assert_state_equal,
    assert_unchanged,
    make_model,
    mixin_modules,
    run_steps,
    snapshot,
)
from torch import nn

import fp8state
from fp8state.errors import (
    ConfigError,
    FP8StateError,
    LegacyFormatError,
    SchemaError,
    SchemaVersionError,
)
from fp8state.formats import Format
from fp8state.mixin import DEFAULT_HISTORY_ROWS
from fp8state.recipe import DelayedScaling


class Bare(fp8state.FP8StateMixin):
    """A mixin module with no parameters or buffers of its own."""

    def __init__(self, num_gemms: int = 1, **kwargs: Any) -> None:
        super().__init__()
        self.init_fp8_meta(num_gemms=num_gemms, **kwargs)


def save_load(obj: Any) -> Any:
    """torch.save then torch.load(weights_only=True), no safe globals added."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


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
    assert set(payload) == KEYS_V1 and all(t.is_meta for t in payload.values())
    assert payload["fwd.amax_history"].shape == (16, 6)


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
    payload = m.get_extra_state()
    assert set(payload) == KEYS_V1
    assert all(type(k) is str and type(v) is torch.Tensor for k, v in payload.items())
    assert all(v.device.type == "cpu" for v in payload.values())
    live = {m.fp8_meta(d)[i].untyped_storage().data_ptr() for d in ("fwd", "bwd")
            for i in range(3)}
    assert not live & {v.untyped_storage().data_ptr() for v in payload.values()}
    for d in ("fwd", "bwd"):
        for field in ("amax_history", "scale", "scale_inv"):
            torch.testing.assert_close(
                payload[f"{d}.{field}"], getattr(m, f"fp8_{d}_{field}").cpu(), atol=0, rtol=0
            )
    payload["fwd.scale"].fill_(7.0)  # writing the copy leaves the module alone
    assert not torch.equal(m.fp8_fwd_scale.cpu(), payload["fwd.scale"])


def test_get_extra_state_values() -> None:
    recipe = DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=5,
                            amax_compute_algo="most_recent")
    p = Bare(3, history_rows=9, recipe=recipe).get_extra_state()
    assert p["schema_version"].dtype == torch.int64 and p["schema_version"].dim() == 0
    assert p["schema_version"].item() == 1
    scalars = {k.removeprefix("recipe."): v.item() for k, v in p.items() if k.startswith("recipe.")}
    assert scalars == {"fp8_format": 0, "margin": 2, "amax_history_len": 5, "amax_compute_algo": 1}
    assert all(p[k].dtype == torch.int64 and p[k].dim() == 0 for k in p if k.startswith("recipe"))
    assert p["fwd.amax_history"].shape == (9, 9) and p["bwd.amax_history"].shape == (9, 6)


# ---------------------------------------------------------------- save / load round trip


def test_model_round_trip_through_torch_save_weights_only(tmp_path: Any, seed: int) -> None:
    model = make_model(3, hidden=4)
    model.blocks[1].fp8_update_scales(
        "fwd", DelayedScaling(margin=1, fp8_format=Format.E4M3, amax_history_len=7,
                              amax_compute_algo="most_recent"),
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
    sd = torch.load(io.BytesIO(_bytes(src.state_dict())), weights_only=True, map_location=device)
    dst.load_state_dict(sd)
    assert {getattr(m, b).device.type for m in mixin_modules(dst).values()
            for b in FP8_BUFFERS} == {device.type}
    assert_state_equal(dst, src)


def test_payload_on_another_device_is_copied_to_the_modules(device: torch.device) -> None:
    src = TwoGemm()
    run_steps(src, 3)
    payload = {k: v.to(device) for k, v in src.get_extra_state().items()}
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


def _bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


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
    [pytest.param(8, 16, id="fewer-zero-pad"), pytest.param(32, 16, id="more-grow"),
     pytest.param(1, 1024, id="1-into-1024")],
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
        torch.testing.assert_close(hist[:rows_ck].cpu(), payload[f"{d}.amax_history"],
                                   atol=0, rtol=0)  # nothing dropped
        assert not hist[rows_ck:].any()  # zero-padded
        for f in ("scale", "scale_inv"):
            torch.testing.assert_close(getattr(m, f"fp8_{d}_{f}").cpu(), payload[f"{d}.{f}"],
                                       atol=0, rtol=0)
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


# ---------------------------------------------------------------- bad input


def _valid_source() -> TwoGemm:
    torch.manual_seed(7)
    src = TwoGemm()
    run_steps(src, 4, seed=7)
    return src


def _target() -> TwoGemm:
    torch.manual_seed(8)  # different parameters from the source's
    m = TwoGemm()
    m.fp8_update_scales("fwd", DelayedScaling(margin=3, amax_history_len=4))
    run_steps(m, 3, seed=8)
    m.fp8_record_amax("fwd", 0, torch.tensor(2.5))  # mid-step: the step flag is False
    return m


# ``None`` is not a payload, but set_extra_state reads it as TransformerEngine's "no FP8 state"
# (TE up to v0.5 saved it for modules that never ran FP8), so through the mixin it is valid.
LEGACY_VALID = {"nondict-none"}
CASES = [pytest.param(m, e, k, id=i) for i, m, e, k in CORRUPTIONS if i not in LEGACY_VALID]


def check_error(err: FP8StateError, bad: Any, error: type[FP8StateError], prefix: str,
                key: str) -> None:
    """Values that are not fp8state payloads (no mapping with a schema_version) go to the
    TransformerEngine decoder, whose errors are LegacyFormatErrors; payloads get the schema's."""
    assert err.key.startswith(prefix), err.key
    assert str(err).startswith(prefix)
    if isinstance(bad, Mapping) and "schema_version" in bad:
        assert type(err) is error
        assert key in err.key, (err.key, key)
    else:
        assert isinstance(err, (SchemaError, LegacyFormatError)), type(err)


@pytest.mark.parametrize(("mutate", "error", "key"), CASES)
def test_bad_input_set_extra_state_leaves_module_unchanged(
    mutate: Mutation, error: type[FP8StateError], key: str
) -> None:
    m = _target()
    before = snapshot(m)
    bad = mutate(_valid_source().get_extra_state())
    with pytest.raises(FP8StateError) as info:
        m.set_extra_state(bad)
    check_error(info.value, bad, error, "TwoGemm._extra_state", key)
    assert_unchanged(m, before)


@pytest.mark.parametrize(("mutate", "error", "key"), CASES)
def test_bad_input_load_state_dict_names_key_and_leaves_model_unchanged(
    mutate: Mutation, error: type[FP8StateError], key: str
) -> None:
    # The bad module comes first in load order, so a failed load must leave the whole model as
    # it was (parameters of the module itself included).
    torch.manual_seed(3)
    src = nn.Sequential()
    src.add_module("blocks", nn.ModuleList([TwoGemm(), TwoGemm()]))
    run_steps(src, 2)
    sd = save_load(src.state_dict())
    sd["blocks.0._extra_state"] = mutate(sd["blocks.0._extra_state"])
    torch.manual_seed(4)
    model = nn.Sequential()
    model.add_module("blocks", nn.ModuleList([_target(), _target()]))
    before = snapshot(model)
    with pytest.raises(FP8StateError) as info:
        model.load_state_dict(sd)
    check_error(info.value, sd["blocks.0._extra_state"], error, "blocks.0._extra_state", key)
    assert_unchanged(model, before)


@pytest.mark.parametrize("key", [pytest.param(None, id="None"), pytest.param(0, id="int")])
def test_non_str_key_without_schema_version(key: Any) -> None:
    # A dict without schema_version goes to the TransformerEngine decoder; a non-str key there
    # must still be an FP8StateError.
    m = _target()
    before = snapshot(m)
    bad: dict[Any, Any] = {k: v for k, v in _valid_source().get_extra_state().items()
                           if k != "schema_version"}
    bad[key] = torch.zeros(2)
    with pytest.raises(FP8StateError):
        m.set_extra_state(bad)
    assert_unchanged(m, before)


@pytest.mark.parametrize("version", [0, 2, 99])
def test_error_inside_load_state_dict_names_the_state_dict_key(version: int) -> None:
    model = make_model(3)
    sd = model.state_dict()
    sd["blocks.1._extra_state"]["schema_version"] = torch.tensor(version)
    with pytest.raises(SchemaVersionError) as info:
        make_model(3).load_state_dict(sd)
    assert info.value.key == "blocks.1._extra_state['schema_version']"
    assert f"version {version}" in str(info.value)


def test_num_gemms_mismatch_names_both_counts() -> None:
    with pytest.raises(SchemaError) as info:
        Bare(1).set_extra_state(TwoGemm().get_extra_state())
    assert "2 GEMM" in info.value.found and "1 GEMM" in info.value.expected


# ---------------------------------------------------------------- delayed scaling


def test_row0_is_most_recent_and_first_record_shifts() -> None:
    m = Bare(1, history_rows=4)
    for step, amax in enumerate([1.0, 2.0, 3.0, 4.0, 5.0]):
        m.fp8_record_amax("fwd", 0, torch.tensor(amax))
        assert m.fp8_fwd_amax_history[0, 0].item() == amax, step
        m.fp8_update_scales("fwd")
    torch.testing.assert_close(
        m.fp8_fwd_amax_history[:, 0], torch.tensor([5.0, 4.0, 3.0, 2.0]), atol=0, rtol=0
    )


def test_records_within_a_step_take_the_max() -> None:
    m = Bare(1, history_rows=3)
    m.fp8_record_amax("fwd", 0, torch.tensor(1.0))
    m.fp8_update_scales("fwd")
    for amax in (3.0, 5.0, 2.0):  # micro-batches of one step
        m.fp8_record_amax("fwd", 0, torch.tensor(amax))
    m.fp8_record_amax("fwd", 1, torch.tensor(0.5))  # another slot, same step: no new shift
    want = torch.tensor([[5.0, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(m.fp8_fwd_amax_history, want, atol=0, rtol=0)


def test_directions_step_independently() -> None:
    m = Bare(1, history_rows=3)
    m.fp8_record_amax("fwd", 0, torch.tensor(1.0))
    m.fp8_update_scales("fwd")
    m.fp8_record_amax("fwd", 0, torch.tensor(2.0))
    m.fp8_record_amax("bwd", 1, torch.tensor(9.0))
    torch.testing.assert_close(m.fp8_fwd_amax_history[:, 0], torch.tensor([2.0, 1.0, 0.0]),
                               atol=0, rtol=0)
    torch.testing.assert_close(m.fp8_bwd_amax_history[:, 1], torch.tensor([9.0, 0.0, 0.0]),
                               atol=0, rtol=0)


def test_update_without_records_does_not_shift() -> None:
    m = Bare(1, history_rows=3)
    m.fp8_record_amax("fwd", 0, torch.tensor(4.0))
    m.fp8_update_scales("fwd")
    hist, scale = m.fp8_fwd_amax_history.clone(), m.fp8_fwd_scale.clone()
    m.fp8_update_scales("fwd")
    torch.testing.assert_close(m.fp8_fwd_amax_history, hist, atol=0, rtol=0)
    torch.testing.assert_close(m.fp8_fwd_scale, scale, atol=0, rtol=0)


def test_non_finite_amax_is_recorded_as_zero_and_keeps_scale() -> None:
    m = Bare(1, history_rows=2, recipe=DelayedScaling(amax_history_len=1))
    m.fp8_record_amax("fwd", 0, torch.tensor(float("inf")))
    m.fp8_record_amax("fwd", 1, torch.tensor(float("nan")))
    m.fp8_update_scales("fwd")
    assert not m.fp8_fwd_amax_history.any()
    torch.testing.assert_close(m.fp8_fwd_scale, torch.ones(3), atol=0, rtol=0)
    fresh = Bare(1, history_rows=2)
    fresh.set_extra_state(m.get_extra_state())  # the checkpoint stays valid


def test_load_starts_a_new_step() -> None:
    src = Bare(1, history_rows=3)
    src.fp8_record_amax("fwd", 0, torch.tensor(2.0))
    src.fp8_update_scales("fwd")
    m = Bare(1, history_rows=3)
    m.fp8_record_amax("fwd", 0, torch.tensor(100.0))  # mid-step before the load
    m.set_extra_state(src.get_extra_state())
    m.fp8_record_amax("fwd", 0, torch.tensor(3.0))
    torch.testing.assert_close(m.fp8_fwd_amax_history[:, 0], torch.tensor([3.0, 2.0, 0.0]),
                               atol=0, rtol=0)


RECIPES = [
    DelayedScaling(amax_history_len=16),
    DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_history_len=4),
    DelayedScaling(margin=1, amax_history_len=16, amax_compute_algo="most_recent"),
    DelayedScaling(margin=5, fp8_format=Format.E4M3, amax_history_len=1),
]


def _recipe_id(r: DelayedScaling) -> str:
    return f"{r.fp8_format.name}-m{r.margin}-w{r.amax_history_len}-{r.amax_compute_algo}"


@pytest.mark.parametrize("recipe", RECIPES, ids=_recipe_id)
def test_scale_formula_holds_for_the_history_as_saved(recipe: DelayedScaling) -> None:
    m = TwoGemm(history_rows=16)
    gen = torch.Generator().manual_seed(0)
    for step in range(20):
        for d, n in (("fwd", 6), ("bwd", 4)):
            amax = torch.exp2(torch.rand(n, generator=gen) * 40 - 20)
            if step < 15:
                amax[step % n] = 0.0  # an unused slot now and then (outside the last window)
            for slot in range(n):
                m.fp8_record_amax(d, slot, amax[slot])
            m.fp8_update_scales(d, recipe)
    p = save_load(m.state_dict())["_extra_state"]
    assert m.fp8_recipe == recipe
    window = int(p["recipe.amax_history_len"])
    for d in ("fwd", "bwd"):
        hist = p[f"{d}.amax_history"].numpy()
        amax = hist[0] if recipe.amax_compute_algo == "most_recent" else hist[:window].max(0)
        assert (amax > 0).all()
        fp8_max = np.float32(recipe.fp8_format.max(d))
        want = fp8_max / amax / np.float32(2.0**recipe.margin)
        torch.testing.assert_close(p[f"{d}.scale"], torch.from_numpy(want), atol=0, rtol=0)
        torch.testing.assert_close(p[f"{d}.scale_inv"], torch.from_numpy(np.float32(1) / want),
                                   atol=0, rtol=0)


def test_formats_use_their_direction_max() -> None:
    m = Bare(1, history_rows=1)
    for d in ("fwd", "bwd"):
        m.fp8_record_amax(d, 0, torch.tensor(1.0))
        m.fp8_update_scales(d)
    assert m.fp8_fwd_scale[0].item() == 448.0 and m.fp8_bwd_scale[0].item() == 57344.0


def test_recipe_window_longer_than_buffer_grows_with_one_warning() -> None:
    m = TwoGemm(history_rows=4)
    run_steps(m, 4)
    hist = {d: getattr(m, f"fp8_{d}_amax_history").clone() for d in ("fwd", "bwd")}
    long = DelayedScaling(amax_history_len=10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.fp8_update_scales("fwd", long)
        m.fp8_update_scales("bwd", long)
    assert len(caught) == 1 and "4" in str(caught[0].message) and "10" in str(caught[0].message)
    for d in ("fwd", "bwd"):
        grown = getattr(m, f"fp8_{d}_amax_history")
        assert grown.shape[0] == 10
        torch.testing.assert_close(grown[:4], hist[d], atol=0, rtol=0)
        assert not grown[4:].any()
    fresh = TwoGemm(history_rows=10)
    fresh.load_state_dict(save_load(m.state_dict()))
    assert_state_equal(fresh, m)


def test_assigning_a_longer_recipe_grows_the_history_so_saves_stay_loadable() -> None:
    module = TwoGemm(history_rows=8)
    with pytest.warns(UserWarning, match="from 8 to 32 rows"):
        module.fp8_recipe = DelayedScaling(amax_history_len=32)
    assert module.fp8_meta("fwd").amax_history.shape[0] == 32
    fresh = TwoGemm(history_rows=8)
    with pytest.warns(UserWarning, match="32 rows, the module 8"):
        fresh.load_state_dict(module.state_dict())
    assert fresh.fp8_recipe == module.fp8_recipe


def test_assigning_a_non_recipe_is_refused() -> None:
    module = TwoGemm()
    with pytest.raises(FP8StateError, match="fp8_recipe"):
        module.fp8_recipe = "max"  # type: ignore[assignment]
