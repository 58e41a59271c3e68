"""``FP8StateMixin.set_extra_state`` takes TE values directly: ``load_state_dict(te_sd)`` works."""

from __future__ import annotations

import warnings

import pytest
import torch
from _helpers.state import fields, live_payload
from te_gen import ERAS, Spec, extra_state
from te_gen.expect import assert_matches_truth

import fp8state
from fp8state.errors import LegacyFormatError, SchemaError, UnsafeCheckpointError
from fp8state.recipe import DelayedScaling

# TE histories are shorter than the modules' buffers: the mixin zero-pads, with one warning.
pytestmark = pytest.mark.filterwarnings("ignore:.*amax history has:UserWarning")


class TwoGemms(fp8state.FP8StateMixin):
    """A custom module with two GEMMs and a short history buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(4, 4))
        self.w2 = torch.nn.Parameter(torch.randn(4, 4))
        self.init_fp8_meta(
            num_gemms=2, history_rows=32, recipe=DelayedScaling(margin=1, amax_history_len=8)
        )


@pytest.mark.parametrize("era", ERAS)
def test_set_extra_state_accepts_every_era(era: str) -> None:
    value, truth = extra_state(era, Spec(num_gemms=2, rows=12, steps=20, seed=9))
    module = TwoGemms()
    module.load_state_dict(
        {"w1": module.w1.detach(), "w2": module.w2.detach(), "_extra_state": value}, strict=True
    )
    assert truth is not None and module.fp8_meta("fwd").amax_history.shape == (32, 6)
    assert_matches_truth(live_payload(module, 12), truth)
    assert bool((module.fp8_meta("bwd").amax_history[12:] == 0).all())


@pytest.mark.parametrize("era", ERAS)
def test_te_value_without_fp8_state_loads_fresh_metadata(era: str) -> None:
    value, _ = extra_state(era, Spec(fp8=False))
    module = TwoGemms()
    trained, _ = extra_state("E09", Spec(num_gemms=2, rows=32, steps=40))
    module.set_extra_state(trained)  # some earlier state, to be replaced
    recipe = DelayedScaling(margin=3, amax_history_len=16)
    module.fp8_recipe = recipe
    module.set_extra_state(value)
    for d in ("fwd", "bwd"):
        meta = module.fp8_meta(d)
        assert bool((meta.amax_history == 0).all()) and meta.amax_history.shape[0] == 32
        assert bool((meta.scale == 1).all()) and bool((meta.scale_inv == 1).all())
    assert module.fp8_recipe == recipe  # the checkpoint has no recipe: the module keeps its own


def test_bad_te_value_names_the_key_and_leaves_the_module_unchanged() -> None:
    parent = torch.nn.Module()
    parent.block = TwoGemms()
    good, _ = extra_state("E07", Spec(num_gemms=2, rows=12, steps=20))
    parent.block.set_extra_state(good)
    before = {k: v.clone() for k, v in fields(parent.block.get_extra_state()).items()}
    bad, _ = extra_state("E07", Spec(num_gemms=1))  # a Linear's state into a 2-GEMM module
    sd = {"block.w1": torch.zeros(4, 4), "block.w2": torch.zeros(4, 4), "block._extra_state": bad}
    with pytest.raises(LegacyFormatError) as info:
        parent.load_state_dict(sd)
    assert info.value.key == "block._extra_state" and "1 GEMM" in info.value.found
    after = fields(parent.block.get_extra_state())
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(LegacyFormatError, match=r"^TwoGemms\._extra_state: "):
        parent.block.set_extra_state(bad)


def test_unsafe_te_value_is_refused_by_set_extra_state() -> None:
    from te_gen.adversarial import in_uint8_pickle, payloads

    obj, _ = payloads("/nonexistent/marker")["builtins.eval"]
    with pytest.raises(UnsafeCheckpointError, match="builtins.eval"):
        fp8state.Linear(4, 4).set_extra_state(in_uint8_pickle(obj))


def test_fp8state_payloads_still_take_the_schema_path() -> None:
    source = TwoGemms()
    value, _ = extra_state("E10", Spec(num_gemms=2, rows=8, steps=9))
    source.set_extra_state(value)
    target = TwoGemms()
    target.load_state_dict(source.state_dict(), strict=True)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            fields(source.get_extra_state()).values(),
            fields(target.get_extra_state()).values(),
            strict=True,
        )
    )
    # A schema payload missing its version is not taken for a TE value silently.
    payload = fields(source.get_extra_state())
    del payload["schema_version"]
    with pytest.raises(LegacyFormatError, match="schema_version"):
        target.set_extra_state(payload)
    payload = fields(source.get_extra_state())
    payload["fwd.scale"] = payload["fwd.scale"][:3]
    with pytest.raises(SchemaError):
        target.set_extra_state(payload)


def test_linear_loads_te_state_dict_directly() -> None:
    value, truth = extra_state("E05", Spec(rows=16, steps=30))
    linear = fp8state.Linear(8, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        linear.load_state_dict(
            {"weight": torch.ones(12, 8), "bias": torch.zeros(12), "_extra_state": value},
            strict=True,
        )
    assert truth is not None
    assert_matches_truth(live_payload(linear, 16), truth)
    assert any("16 rows" in str(w.message) for w in caught)  # zero-padded to the module's 1024
