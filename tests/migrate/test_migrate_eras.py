"""Every era of te_formats.md, generated (te_gen): shapes, recipes, history lengths, nested names,
FP8-off modules, stateless recipes and the old 2/1 slot layout, checked against the truth."""

from __future__ import annotations

import collections
import io
import warnings
from typing import Any

import pytest
import torch
from _helpers.models import save_load
from _helpers.state import fields, live_payload, sub_state_dict
from te_gen import ERAS, Module, Spec, build, extra_state, save
from te_gen.expect import assert_matches_truth

import fp8state
from fp8state.migrate import (
    convert_te_state_dict,
    decode_te_extra_state,
    decode_te_value,
    migrate_te_checkpoint,
)

CASES = {
    "linear-default": Spec(),
    "mlp-e4m3-margin-recent": Spec(
        num_gemms=2, rows=5, steps=9, fmt="E4M3", margin=2, algo="most_recent", seed=1
    ),
    "one-row": Spec(rows=1, steps=3, seed=2),
    "fewer-steps-than-rows": Spec(rows=40, steps=4, seed=3),
    "long-history": Spec(rows=1024, steps=6, seed=4),
    "attention-no-dpa": Spec(num_gemms=3, quantizes=False, seed=5),
    "grouped-5": Spec(num_gemms=5, rows=8, steps=20, seed=6),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("era", ERAS)
def test_extra_state_matches_truth(era: str, case: str) -> None:
    spec = CASES[case]
    value, truth = extra_state(era, spec)
    decoded = decode_te_value(value, num_gemms=spec.num_gemms)
    assert truth is not None and decoded.payload is not None
    assert_matches_truth(decoded.payload, truth)
    assert decoded.defaulted == truth.defaulted
    assert decoded.num_gemms == spec.num_gemms and decoded.rows == spec.rows
    fwd, bwd = (2, 1) if era in ("E01", "E02", "E03") else (3, 2)
    assert decoded.te_slots == (spec.num_gemms * fwd, spec.num_gemms * bwd)
    if era in ("E04", "E05", "E06", "E07"):
        assert decoded.locations == {"cuda:0"}  # read onto the CPU all the same
    # The public function returns the same payload, and agrees without num_gemms too.
    again = decode_te_extra_state(value)
    assert again is not None and torch.equal(again, decoded.payload)


@pytest.mark.parametrize("era", ERAS)
def test_fp8_never_ran(era: str) -> None:
    value, truth = extra_state(era, Spec(fp8=False))
    assert truth is None
    assert decode_te_extra_state(value, num_gemms=1) is None


@pytest.mark.parametrize(
    "kind", ["Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling", "NVFP4BlockScaling"]
)
@pytest.mark.parametrize("era", ["E08", "E09", "E10"])
def test_stateless_recipes_hold_no_state(era: str, kind: str) -> None:
    value, _ = extra_state(era, Spec(stateless=kind))
    decoded = decode_te_value(value, num_gemms=1)
    assert decoded.payload is None
    if era == "E10":  # v2.16.1+: stateless recipes write an empty tensor (PR #3123)
        assert isinstance(value, torch.Tensor) and value.numel() == 0
    else:
        assert kind in decoded.notes[0]


def test_era_variants_with_extra_contents() -> None:
    # E02 with FP8 activation-recompute deques, E07 as v1.6-v1.7 wrote it, E09 attention with
    # local_recipes: the extra contents are dropped, the FP8 state is converted.
    for era, spec in [
        ("E02", Spec(recompute_deques=True)),
        ("E07", Spec(v16_autocast_key=True)),
        ("E09", Spec(num_gemms=3, local_recipes=True)),
        ("E10", Spec(num_gemms=3, local_recipes=True)),
    ]:
        value, truth = extra_state(era, spec)
        assert truth is not None
        assert_matches_truth(decode_te_extra_state(value, num_gemms=spec.num_gemms), truth)
    value, _ = extra_state("E02", Spec(recompute_deques=True))
    assert isinstance(value["global_fp8_recompute_buffer"][0], collections.deque)


def _model(era: str) -> list[Module]:
    mods = [
        Module("encoder.layers.0.self_attention.layernorm_qkv.", "QKV", hidden=16),
        Module(
            "encoder.layers.0.self_attention.proj.",
            "Linear",
            hidden=16,
            out=16,
            spec=Spec(rows=6, steps=11, seed=1),
        ),
        Module(
            "encoder.layers.0.layernorm_mlp.",
            "LayerNormMLP",
            hidden=16,
            out=32,
            spec=Spec(rows=6, steps=11, seed=2),
        ),
        Module("encoder.final_norm.", "LayerNorm", hidden=16),
        Module("lm_head.", "Linear", hidden=16, out=24, bias=False, spec=Spec(fp8=False)),
        Module("adapter.", "LayerNormLinear", hidden=16, out=8, spec=Spec(fp8=False)),
    ]
    if era >= "E07":
        mods += [
            Module(
                "encoder.layers.0.self_attention.core_attention.",
                "DotProductAttention",
                spec=Spec(quantizes=False, local_recipes=era >= "E09"),
            ),
            Module("moe.experts.", "GroupedLinear", hidden=16, out=8, groups=4),
        ]
    return mods


@pytest.mark.parametrize("era", ERAS)
def test_generated_checkpoint_round_trip(era: str, tmp_path: Any) -> None:
    gen = build(era, _model(era), seed=7)
    path = tmp_path / "te.pt"
    saved = save(gen, path, wrap="model")
    converted, report = migrate_te_checkpoint(path)
    # Same structure: the state dict converted under "model", the rest untouched.
    assert list(converted) == list(saved) and report.state_dicts == ["model"]
    assert converted["iteration"] == 7 and converted["note"] == saved["note"]
    assert torch.equal(converted["optimizer"]["state"][0]["step"], torch.tensor(3.0))
    sd = converted["model"]
    assert sd._metadata == gen.state_dict._metadata  # type: ignore[attr-defined]
    for key, value in gen.state_dict.items():
        if not key.endswith("_extra_state"):
            assert torch.equal(sd[key], value) and sd[key].device.type == "cpu"
    for prefix, truth in gen.truths.items():
        if truth is not None:
            assert_matches_truth(sd[f"{prefix}_extra_state"], truth)
    assert all(e.key.startswith("model/") for e in report.entries)
    actions = {e.key.split("/", 1)[1]: e.action for e in report.entries}
    assert actions["lm_head._extra_state"] == "default"
    assert actions["adapter._extra_state"] == "default"
    if era >= "E07":
        assert actions["encoder.final_norm._extra_state"] == "dropped"
        assert actions["moe.experts._extra_state"] == "converted"
        assert fields(sd["moe.experts._extra_state"])["fwd.scale"].shape == (12,)
    # The result is what torch.load(weights_only=True) reads, without any allow-listing.
    assert save_load(converted)["model"].keys() == sd.keys()


@pytest.mark.parametrize("era", ERAS)
def test_generated_state_dict_loads_into_fp8state_modules(era: str) -> None:
    mods = [
        Module("a.b.", "Linear", hidden=8, out=4, spec=Spec(rows=3, steps=5)),
        Module("c.", "LayerNormLinear", hidden=8, out=4, bias=False),
        Module("d.", "LayerNormMLP", hidden=8, out=16, spec=Spec(rows=2048, steps=3)),
        Module("e.", "Linear", hidden=8, out=4, spec=Spec(fp8=False)),
    ]
    gen = build(era, mods)
    converted, _ = convert_te_state_dict(gen.state_dict)
    made = {
        "a.b.": fp8state.Linear(8, 4),
        "c.": fp8state.LayerNormLinear(8, 4, bias=False),
        "d.": fp8state.LayerNormMLP(8, 16),
        "e.": fp8state.Linear(8, 4),
    }
    for prefix, module in made.items():
        for sd in (converted, gen.state_dict):  # converted, and raw TE values
            sub = sub_state_dict(sd, prefix)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module.load_state_dict(sub, strict=True)
            truth = gen.truths[prefix]
            if truth is None:
                assert bool((module.fp8_meta("fwd").amax_history == 0).all())
                continue
            rows = truth.rows
            assert module.fp8_meta("fwd").amax_history.shape[0] == max(rows, 1024)
            assert_matches_truth(live_payload(module, rows), truth)


def test_input_state_dict_is_not_modified() -> None:
    gen = build("E06", [Module("x.", "Linear"), Module("n.", "LayerNorm")])
    before = dict(gen.state_dict)
    convert_te_state_dict(gen.state_dict)
    assert dict(gen.state_dict).keys() == before.keys()
    assert all(gen.state_dict[k] is v for k, v in before.items())
    buf = gen.state_dict["x._extra_state"]
    assert isinstance(buf, io.BytesIO) and buf.tell() == len(buf.getvalue())
