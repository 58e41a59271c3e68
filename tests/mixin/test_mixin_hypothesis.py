"""Property-based tests of set_extra_state: every random corruption of a valid payload raises an
FP8StateError and leaves the module bit-for-bit unchanged; every valid random payload
round-trips exactly."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from _helpers.corruptions import KEYS_V1, copy_payload
from _helpers.models import run_steps
from _helpers.state import assert_unchanged, fields, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp8state
from fp8state.errors import FP8StateError
from fp8state.formats import Format
from fp8state.recipe import AMAX_COMPUTE_ALGOS, DelayedScaling
from fp8state.schema import SCHEMA_VERSION

# database=None: no .hypothesis/ directory in the checkout; deadline=None: CPU timing varies.
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
INT64 = st.integers(-(2**63), 2**63 - 1)
F32 = np.float32
F32_MAX = float(np.finfo(F32).max)


class Module(fp8state.FP8StateMixin):
    """A mixin module with one parameter, of any GEMM and row count."""

    def __init__(self, num_gemms: int, rows: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3))
        self.init_fp8_meta(num_gemms=num_gemms, history_rows=rows)


def trained(num_gemms: int, rows: int, seed: int) -> Module:
    torch.manual_seed(seed)
    m = Module(num_gemms, rows)
    run_steps(m, 2, seed=seed)
    return m


# ---------------------------------------------------------------- valid payloads

finite_pos = st.floats(
    min_value=float(np.finfo(F32).smallest_subnormal),
    max_value=F32_MAX,
    width=32,
    allow_nan=False,
    allow_infinity=False,
)
finite_nonneg = st.floats(
    min_value=0.0, max_value=F32_MAX, width=32, allow_nan=False, allow_infinity=False
)


@st.composite
def float_array(
    draw: st.DrawFn, shape: tuple[int, ...], elements: st.SearchStrategy[float], low: float
) -> torch.Tensor:
    """Random float32 values over many binades (from a drawn seed), with a few drawn values
    (extremes, subnormals, zeros where allowed) written at drawn positions."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    t = torch.exp2(torch.rand(shape, generator=gen) * 100 - 50)
    if low == 0.0:
        t[torch.rand(shape, generator=gen) < 0.2] = 0.0
    flat = t.view(-1)
    for value in draw(st.lists(elements, max_size=4)):
        flat[draw(st.integers(0, flat.numel() - 1))] = value
    return t


@st.composite
def valid_payloads(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    gemms = draw(st.integers(1, 3))
    rows = draw(st.integers(1, 64))
    recipe = DelayedScaling(
        margin=draw(st.one_of(st.integers(0, 8), st.integers(0, 2**24))),
        fp8_format=draw(st.sampled_from(Format)),
        amax_history_len=draw(st.integers(1, rows)),
        amax_compute_algo=draw(st.sampled_from(AMAX_COMPUTE_ALGOS)),
    )
    payload = {"schema_version": torch.tensor(1)}
    for d, n in (("fwd", 3 * gemms), ("bwd", 2 * gemms)):
        payload[f"{d}.amax_history"] = draw(float_array((rows, n), finite_nonneg, 0.0))
        payload[f"{d}.scale"] = draw(float_array((n,), finite_pos, 1.0))
        payload[f"{d}.scale_inv"] = draw(float_array((n,), finite_pos, 1.0))
    for field, value in recipe.to_scalars().items():
        payload[f"recipe.{field}"] = torch.tensor(value, dtype=torch.int64)
    return payload


def dims(p: dict[str, Any]) -> tuple[int, int]:
    """(num_gemms, rows) of a valid payload."""
    return p["fwd.scale"].numel() // 3, p["fwd.amax_history"].shape[0]


@SETTINGS
@given(payload=valid_payloads())
def test_valid_payload_round_trips_exactly(payload: dict[str, torch.Tensor]) -> None:
    gemms, rows = dims(payload)
    m = trained(gemms, rows, seed=0)
    m.set_extra_state(copy_payload(payload))
    out = fields(m.get_extra_state())
    assert out.keys() == payload.keys()
    assert int(out["schema_version"]) == 2  # the current version, whatever was loaded
    for k, v in payload.items():
        if k == "schema_version":
            continue
        assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
        assert torch.equal(out[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k
    # And the module keeps working from there (scales stay finite and > 0).
    run_steps(m, 1)
    for d in ("fwd", "bwd"):
        scale = m.fp8_meta(d).scale
        assert torch.isfinite(scale).all() and (scale > 0).all()


@settings(SETTINGS, max_examples=100)
@given(payload=valid_payloads(), module_rows=st.integers(1, 64))
def test_valid_payload_into_other_rows_keeps_every_row(
    payload: dict[str, torch.Tensor], module_rows: int
) -> None:
    gemms, rows = dims(payload)
    m = trained(gemms, module_rows, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.set_extra_state(payload)
    assert len(caught) == (rows != module_rows)
    for d in ("fwd", "bwd"):
        hist = m.fp8_meta(d).amax_history
        assert hist.shape[0] == max(rows, module_rows)
        assert torch.equal(hist[:rows], payload[f"{d}.amax_history"])
        assert not hist[rows:].any()
    assert m.fp8_recipe.to_scalars() == {
        k.removeprefix("recipe."): int(v) for k, v in payload.items() if k.startswith("recipe.")
    }


# ---------------------------------------------------------------- corruptions

FLOAT_KEYS = sorted(k for k in KEYS_V1 if k.startswith(("fwd.", "bwd.")))
INT_KEYS = sorted(k for k in KEYS_V1 if k not in FLOAT_KEYS)
OTHER_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]
NON_TENSORS = st.one_of(
    st.none(),
    st.integers(),
    st.floats(),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.lists(st.integers(), max_size=3),
    st.just(np.zeros(3, F32)),
)


KEY_KINDS = ("drop", "dtype", "shape", "non_tensor", "nested", "meta", "bad_value", "bad_code")


def applicable(key: str, kind: str) -> bool:
    if kind == "bad_value":
        return key in FLOAT_KEYS
    if kind == "bad_code":
        return key in INT_KEYS
    return True


@st.composite
def corrupt_value(draw: st.DrawFn, key: str, p: dict[str, Any], kinds: tuple[str, ...]) -> Any:
    """A value for ``key`` that no valid payload of the same shapes may hold (or ``DROP``)."""
    t: torch.Tensor = p[key]
    rows = p["fwd.amax_history"].shape[0]
    kind = draw(st.sampled_from([k for k in kinds if applicable(key, k)]))
    if kind == "drop":
        return DROP
    if kind == "dtype":
        dtype = draw(st.sampled_from([d for d in OTHER_DTYPES if d != t.dtype]))
        return t.to(dtype)
    if kind == "shape":
        if t.dim() == 0:
            return t.reshape(draw(st.sampled_from([(1,), (1, 1)])))
        if t.dim() == 1:  # slot count off by one, or an extra dimension
            return draw(
                st.sampled_from(
                    [
                        torch.cat([t, t[:1]]),
                        t[:-1],
                        t[:, None],
                        t.reshape(1, -1),
                    ]
                )
            )
        return draw(
            st.sampled_from(
                [  # history: columns off by one, or the wrong rank
                    torch.cat([t, t[:, :1]], dim=1),
                    t[:, :-1],
                    t.reshape(-1),
                    t[..., None],
                ]
            )
        )
    if kind == "non_tensor":
        return draw(NON_TENSORS)
    if kind == "nested":
        return {draw(st.text(max_size=3)): t}
    if kind == "meta":
        return t.to("meta")
    if kind == "bad_value":
        bad = [float("nan"), float("inf"), float("-inf"), -1.0, -F32_MAX, -1e-45]
        if not key.endswith("amax_history"):
            bad += [0.0, -0.0]
        t = t.clone()
        t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from(bad))
        return t
    # bad_code
    if key == "schema_version":  # every version this fp8state reads is a good code
        value = draw(INT64.filter(lambda v: not 1 <= v <= SCHEMA_VERSION))
    elif key in ("recipe.fp8_format", "recipe.amax_compute_algo"):
        value = draw(INT64.filter(lambda v: v not in (0, 1)))
    elif key == "recipe.margin":
        value = draw(st.integers(-(2**63), -1))
    else:  # recipe.amax_history_len: 0, negative or longer than the history
        value = draw(st.one_of(st.integers(-(2**63), 0), st.integers(rows + 1, 2**63 - 1)))
    return torch.tensor(value, dtype=torch.int64)


DROP = object()


@st.composite
def corrupt_payloads(
    draw: st.DrawFn, kinds: tuple[str, ...] = KEY_KINDS, structure: bool = True
) -> tuple[Any, tuple[int, int]]:
    """A valid payload with 1-3 of its keys corrupted (distinct keys, so no two corruptions can
    cancel out); with ``structure``, maybe extra keys, maybe then wrapped or replaced whole."""
    p = draw(valid_payloads())
    shape = dims(p)
    candidates = sorted(k for k in KEYS_V1 if any(applicable(k, kind) for kind in kinds))
    n_keys = draw(st.sampled_from([1, 1, 1, 2, 3]))
    keys = draw(
        st.lists(st.sampled_from(candidates), min_size=n_keys, max_size=n_keys, unique=True)
    )
    out: Any = dict(p)
    for key in keys:
        value = draw(corrupt_value(key, p, kinds))
        if value is DROP:
            del out[key]
        else:
            out[key] = value
    if not structure:
        return out, shape
    extra = draw(st.sampled_from([0, 0, 0, 1, 2]))
    for _ in range(extra):
        key = draw(
            st.one_of(
                st.text(max_size=12).filter(lambda k: k not in KEYS_V1),
                st.integers(),
                st.tuples(st.integers()),
                st.none(),
            )
        )
        out[key] = draw(st.one_of(st.just(torch.zeros(2)), NON_TENSORS))
    whole = draw(st.sampled_from(["none"] * 6 + ["wrap", "list", "tensor", "other"]))
    if whole == "wrap":
        out = {draw(st.sampled_from(["state", "_extra_state", "fwd"])): out}
    elif whole == "list":
        out = list(out.items())
    elif whole == "tensor":  # not TE's "no FP8 state" (an empty uint8 tensor), not a pickle
        out = torch.zeros(draw(st.integers(1, 8)), dtype=torch.uint8)
    elif whole == "other":  # not None: set_extra_state reads None as TE's "no FP8 state"
        out = draw(st.one_of(st.text(max_size=5), st.integers(), st.binary(), st.floats()))
    return out, shape


@SETTINGS
@given(case=corrupt_payloads())
def test_corrupt_payload_raises_and_changes_nothing(case: tuple[Any, tuple[int, int]]) -> None:
    bad, (gemms, rows) = case
    m = trained(gemms, rows, seed=2)
    m.fp8_record_amax("fwd", 0, torch.tensor(3.0))  # mid-step, so the step flag is False
    before = snapshot(m)
    with pytest.raises(FP8StateError):
        m.set_extra_state(bad)
    assert_unchanged(m, before)


@settings(SETTINGS, max_examples=150)
@given(case=corrupt_payloads(kinds=("bad_value", "bad_code"), structure=False))
def test_bad_numbers_raise_and_change_nothing(case: tuple[Any, tuple[int, int]]) -> None:
    # Only well-formed tensors with bad numbers (NaN/inf/negative/zero scales, NaN/negative
    # histories, unknown codes, window > rows, unknown versions): the subtle cases.
    bad, (gemms, rows) = case
    m = trained(gemms, rows, seed=4)
    before = snapshot(m)
    with pytest.raises(FP8StateError):
        m.set_extra_state(bad)
    assert_unchanged(m, before)


@settings(SETTINGS, max_examples=100)
@given(case=corrupt_payloads())
def test_corrupt_payload_in_load_state_dict_changes_nothing(
    case: tuple[Any, tuple[int, int]],
) -> None:
    bad, (gemms, rows) = case
    m = trained(gemms, rows, seed=3)
    before = snapshot(m)
    sd = {"weight": torch.full((3,), 5.0), "_extra_state": bad}
    with pytest.raises(FP8StateError) as info:
        m.load_state_dict(sd)
    assert info.value.key.startswith("_extra_state")
    assert_unchanged(m, before)
