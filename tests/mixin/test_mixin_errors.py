"""FP8StateMixin on bad input: every corrupted payload raises an FP8StateError naming the key,
and the module (or the whole model) is left unchanged."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from _helpers.corruptions import CORRUPTIONS, Mutation, fields_of
from _helpers.models import Bare, TwoGemm, make_model, run_steps, save_load
from _helpers.state import assert_unchanged, fields, snapshot
from torch import nn

from fp8state.errors import FP8StateError, LegacyFormatError, SchemaError, SchemaVersionError
from fp8state.recipe import DelayedScaling


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


def check_error(
    err: FP8StateError, bad: Any, error: type[FP8StateError], prefix: str, key: str
) -> None:
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
    bad = mutate(fields_of(_valid_source().get_extra_state()))
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
    sd["blocks.0._extra_state"] = mutate(fields_of(sd["blocks.0._extra_state"]))
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
    bad: dict[Any, Any] = {
        k: v for k, v in fields(_valid_source().get_extra_state()).items() if k != "schema_version"
    }
    bad[key] = torch.zeros(2)
    with pytest.raises(FP8StateError):
        m.set_extra_state(bad)
    assert_unchanged(m, before)


@pytest.mark.parametrize("version", [3, 99])
def test_error_inside_load_state_dict_names_the_state_dict_key(version: int) -> None:
    model = make_model(3)
    sd = model.state_dict()
    sd["blocks.1._extra_state"][0] = float(version)  # the packed header's version
    with pytest.raises(SchemaVersionError) as info:
        make_model(3).load_state_dict(sd)
    assert info.value.key == "blocks.1._extra_state['schema_version']"
    assert f"version {version}" in str(info.value)


def test_num_gemms_mismatch_names_both_counts() -> None:
    with pytest.raises(SchemaError) as info:
        Bare(1).set_extra_state(TwoGemm().get_extra_state())
    assert "2 GEMM" in info.value.found and "1 GEMM" in info.value.expected
