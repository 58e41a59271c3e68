"""DelayedScaling: defaults, validation (RecipeError, a ValueError), scalar round trip; errors."""

from __future__ import annotations

import dataclasses
import itertools
import pickle

import pytest

import fp8state
from fp8state.errors import (
    FP8StateError,
    RecipeError,
    SchemaError,
    SchemaVersionError,
)
from fp8state.formats import Format
from fp8state.recipe import AMAX_COMPUTE_ALGOS, DelayedScaling


def test_defaults_match_te() -> None:
    r = DelayedScaling()
    assert fp8state.DelayedScaling is DelayedScaling
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (
        0,
        Format.HYBRID,
        1024,
        "max",
    )


def test_frozen_and_hashable() -> None:
    r = DelayedScaling(margin=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.margin = 2  # type: ignore[misc]
    assert r == DelayedScaling(margin=1) and hash(r) == hash(DelayedScaling(margin=1))
    assert r != DelayedScaling(margin=2)


INVALID = [
    ("margin", -1),
    ("margin", 1.0),
    ("margin", True),
    ("margin", "0"),
    ("margin", None),
    ("fp8_format", "HYBRID"),
    ("fp8_format", 1),
    ("fp8_format", None),
    ("amax_history_len", 0),
    ("amax_history_len", -5),
    ("amax_history_len", 16.0),
    ("amax_history_len", False),
    ("amax_compute_algo", "mean"),
    ("amax_compute_algo", "MAX"),
    ("amax_compute_algo", max),
    ("amax_compute_algo", None),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_field_raises_recipe_error(field: str, value: object) -> None:
    with pytest.raises(RecipeError) as info:
        DelayedScaling(**{field: value})
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, FP8StateError)
    assert err.key == f"DelayedScaling.{field}"
    assert repr(value) in str(err)


COMBOS = [
    DelayedScaling(margin=m, fp8_format=f, amax_history_len=n, amax_compute_algo=a)
    for m, f, n, a in itertools.product((0, 3), Format, (1, 16, 1024), AMAX_COMPUTE_ALGOS)
]


@pytest.mark.parametrize("recipe", COMBOS, ids=str)
def test_scalars_round_trip(recipe: DelayedScaling) -> None:
    scalars = recipe.to_scalars()
    assert set(scalars) == {"fp8_format", "margin", "amax_history_len", "amax_compute_algo"}
    assert all(type(v) is int for v in scalars.values())
    assert DelayedScaling.from_scalars(scalars) == recipe


def test_scalar_codes() -> None:
    assert DelayedScaling(
        margin=2, fp8_format=Format.E4M3, amax_history_len=7, amax_compute_algo="most_recent"
    ).to_scalars() == {"fp8_format": 0, "margin": 2, "amax_history_len": 7, "amax_compute_algo": 1}
    assert DelayedScaling().to_scalars() == {
        "fp8_format": 1,
        "margin": 0,
        "amax_history_len": 1024,
        "amax_compute_algo": 0,
    }


BAD_SCALARS = [
    ("fp8_format", 2, "recipe.fp8_format"),
    ("fp8_format", -1, "recipe.fp8_format"),
    ("amax_compute_algo", 2, "recipe.amax_compute_algo"),
    ("amax_compute_algo", -1, "recipe.amax_compute_algo"),
    ("margin", -1, "DelayedScaling.margin"),
    ("amax_history_len", 0, "DelayedScaling.amax_history_len"),
]


@pytest.mark.parametrize(
    ("field", "value", "key"), BAD_SCALARS, ids=[f"{f}={v}" for f, v, _ in BAD_SCALARS]
)
def test_from_scalars_rejects_bad_codes(field: str, value: int, key: str) -> None:
    scalars = {**DelayedScaling().to_scalars(), field: value}
    with pytest.raises(RecipeError) as info:
        DelayedScaling.from_scalars(scalars)
    assert info.value.key == key


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "cls",
    [getattr(fp8state.errors, n) for n in fp8state.errors.__all__],
    ids=fp8state.errors.__all__,
)
def test_every_error_is_an_fp8state_error_and_pickles(cls: type[FP8StateError]) -> None:
    assert issubclass(cls, FP8StateError)
    err = cls("k", "found-x", "expected-y", "Do z.")
    if cls is fp8state.errors.StateDictError:  # a list of problems, then the summary line
        assert str(err) == "k: found found-x\nExpected expected-y. Do z."
    else:
        assert str(err) == "k: found found-x; expected expected-y. Do z."
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err)
    fields = (back.key, back.found, back.expected, back.fix)
    assert fields == ("k", "found-x", "expected-y", "Do z.")


def test_under_prefixes_key_and_keeps_type() -> None:
    err = SchemaVersionError("['schema_version']", "version 2", "at most version 1", "Upgrade.")
    moved = err.under("blocks.1._extra_state")
    assert type(moved) is SchemaVersionError and isinstance(moved, SchemaError)
    assert moved.key == "blocks.1._extra_state['schema_version']"
    assert str(moved).startswith("blocks.1._extra_state['schema_version']: found version 2")
