"""Plain PyTorch in and out: load_plain_state_dict, to_plain_state_dict, safetensors files."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from _helpers.models import run_steps
from _helpers.state import assert_same, assert_unchanged, fields, fp8_payloads, snapshot
from _helpers.tiny_lm import TinyLM, tiny_lm, tokens
from _helpers.tiny_lm import converted_tiny_lm as _converted
from torch import nn

import fp8state
from fp8state.checkpoint import (
    StateDictError,
    load_plain_state_dict,
    load_safetensors,
    save_safetensors,
    to_plain_state_dict,
)
from fp8state.errors import CheckpointError, ConfigError
from fp8state.schema import default_payload


# ------------------------------------------------------------------------- export
def test_export_loads_into_the_nn_linear_model_with_strict_load_state_dict() -> None:
    model = _converted(seed=1, trained=True)
    weights = to_plain_state_dict(model)
    plain = TinyLM()
    assert sorted(weights) == sorted(plain.state_dict())
    plain.load_state_dict(weights, strict=True)
    assert torch.equal(plain(tokens()), model(tokens()))
    # The fused norm is back under its own name, with the fused module's values.
    assert torch.equal(weights["blocks.0.ln_1.weight"], model.blocks[0].qkv.layer_norm_weight)


def test_export_is_safetensors_ready_tied_weights_included(tmp_path: Path) -> None:
    model = _converted()
    weights = to_plain_state_dict(model)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in weights.values())
    storages = [t.untyped_storage().data_ptr() for t in weights.values()]
    assert len(storages) == len(set(storages))  # tied emb/head weights are two copies
    assert torch.equal(weights["head.weight"], weights["emb.weight"])
    st.save_file(weights, tmp_path / "model.safetensors")
    plain = TinyLM()
    plain.load_state_dict(st.load_file(tmp_path / "model.safetensors"), strict=True)
    assert plain.head.weight is plain.emb.weight
    assert torch.equal(plain(tokens()), model(tokens()))


def test_separate_metadata_is_flat_tensors_keyed_by_module() -> None:
    model = _converted(trained=True)
    weights, metadata = to_plain_state_dict(model, fp8_metadata="separate")
    assert not any("_extra_state" in k for k in weights)
    payloads = fp8_payloads(model)
    expected = {
        f"{name}._extra_state.{field}": value
        for name, payload in payloads.items()
        for field, value in payload.items()
    }
    assert metadata.keys() == expected.keys()
    assert "blocks.0.qkv._extra_state.fwd.scale" in metadata
    for key, value in expected.items():
        assert metadata[key].dtype == value.dtype and torch.equal(metadata[key], value), key
    for key, value in metadata.items():  # each its own bytes: torch.save writes no more
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size(), key


def test_weights_and_metadata_round_trip_through_safetensors_exactly(tmp_path: Path) -> None:
    model = _converted(seed=1, trained=True)
    weights, metadata = to_plain_state_dict(model, fp8_metadata="separate")
    st.save_file(weights, tmp_path / "w.safetensors")
    st.save_file(metadata, tmp_path / "fp8.safetensors")
    fresh = _converted(seed=2)
    load_plain_state_dict(
        fresh,
        st.load_file(tmp_path / "w.safetensors"),
        fp8_metadata=st.load_file(tmp_path / "fp8.safetensors"),
    )
    assert_same(fresh.state_dict(), model.state_dict())
    assert fresh.blocks[0].qkv.fp8_recipe == model.blocks[0].qkv.fp8_recipe


def test_save_and_load_safetensors_wrappers(tmp_path: Path) -> None:
    model = _converted(seed=1, trained=True)
    weights_file, metadata_file = tmp_path / "w.safetensors", tmp_path / "m.safetensors"
    save_safetensors(model, weights_file, fp8_metadata_path=metadata_file)
    from safetensors import safe_open

    with safe_open(weights_file, "pt") as f:  # the tied head is written once, as save_model does
        assert f.metadata() == {"format": "pt", "head.weight": "emb.weight"}
    fresh = _converted(seed=2)
    load_safetensors(fresh, weights_file, fp8_metadata_path=metadata_file)
    assert_same(fresh.state_dict(), model.state_dict())
    # Weights only, split in two shards as Hugging Face writes large models.
    weights = to_plain_state_dict(model)
    keys = sorted(weights)
    st.save_file({k: weights[k] for k in keys[:10]}, tmp_path / "a.safetensors")
    st.save_file({k: weights[k] for k in keys[10:]}, tmp_path / "b.safetensors")
    fresh = _converted(seed=3, trained=True)
    load_safetensors(fresh, [tmp_path / "a.safetensors", str(tmp_path / "b.safetensors")])
    assert torch.equal(fresh(tokens()), model(tokens()))
    with pytest.raises(CheckpointError, match="each key in one file"):
        load_safetensors(fresh, [tmp_path / "a.safetensors", tmp_path / "a.safetensors"])


def test_missing_safetensors_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(CheckpointError) as info:
        save_safetensors(_converted(), tmp_path / "w.safetensors")
    assert "pip install fp8state[safetensors]" in info.value.fix
    assert not (tmp_path / "w.safetensors").exists()


def test_names_follow_a_wrapper_and_a_part_of_the_converted_model() -> None:
    model = _converted()
    wrapped = nn.Sequential(model)
    assert "0.blocks.0.ln_1.weight" in to_plain_state_dict(wrapped)
    block = to_plain_state_dict(model.blocks[0])
    assert sorted(block) == sorted(TinyLM().blocks[0].state_dict())
    with pytest.raises(CheckpointError) as info:
        to_plain_state_dict(model.blocks[0].qkv)  # the norm is not inside it
    assert "fused from the norm 'blocks.0.ln_1'" in info.value.found
    misplaced = nn.ModuleDict({"x": model.blocks[0].qkv})
    with pytest.raises(CheckpointError, match="fp8_fused_from"):
        to_plain_state_dict(misplaced)
    del model.blocks[0].qkv.fp8_fused_from  # the documented way to keep TE names
    assert "x.layer_norm_weight" in to_plain_state_dict(misplaced)


def test_export_refuses_what_it_cannot_write() -> None:
    with torch.device("meta"):
        model = nn.Sequential(fp8state.Linear(16, 16))
    with pytest.raises(CheckpointError, match="meta device"):
        to_plain_state_dict(model)
    with pytest.raises(ConfigError):
        to_plain_state_dict(_converted(), fp8_metadata="keep")  # type: ignore[call-overload]


# --------------------------------------------------------------------------- load
def test_plain_weights_load_with_fresh_metadata_into_a_trained_model() -> None:
    plain = tiny_lm(seed=5)  # trained without FP8; keys as nn.Linear code writes them
    model = _converted(seed=1, trained=True)
    result = load_plain_state_dict(model, plain.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(model(tokens()), plain(tokens()))
    for payload in fp8_payloads(model).values():
        rows = payload["fwd.amax_history"].shape[0]
        fresh = default_payload(payload["fwd.scale"].numel() // 3, rows=rows)
        assert_same(payload, fields(fresh))
    assert model.blocks[0].qkv.fp8_recipe == fp8state.DelayedScaling()


def test_every_real_problem_is_reported_in_plain_names_and_nothing_changes() -> None:
    model = _converted(seed=1, trained=True)
    before = snapshot(model)
    state = tiny_lm(seed=5).state_dict()
    del state["blocks.0.ln_1.weight"]  # the fused norm, under its plain name
    del state["blocks.1.proj.bias"]
    state["blocks.0.mlp.2.weight"] = torch.zeros(3, 3)
    state["decoder.weight"] = torch.zeros(2)
    with pytest.raises(StateDictError) as info:
        load_plain_state_dict(model, state)
    keys = sorted(p.key for p in info.value.problems)
    assert keys == [
        "blocks.0.ln_1.weight",
        "blocks.0.mlp.2.weight",
        "blocks.1.proj.bias",
        "decoder.weight",
    ]
    assert_unchanged(model, before)


def test_strict_false_returns_missing_and_unexpected_in_plain_names() -> None:
    model = _converted(seed=1)
    state = tiny_lm(seed=5).state_dict()
    del state["blocks.0.ln_1.bias"]
    state["decoder.weight"] = torch.zeros(2)
    result = load_plain_state_dict(model, state, strict=False)
    assert result.missing_keys == ["blocks.0.ln_1.bias"]
    assert result.unexpected_keys == ["decoder.weight"]
    assert torch.equal(model.blocks[1].qkv.weight, state["blocks.1.qkv.weight"])


def test_model_spelling_is_accepted_but_not_twice() -> None:
    model = _converted(seed=1)
    state = tiny_lm(seed=5).state_dict()
    state["blocks.0.qkv.layer_norm_weight"] = state.pop("blocks.0.ln_1.weight")
    load_plain_state_dict(model, state)
    assert torch.equal(
        model.blocks[0].qkv.layer_norm_weight, state["blocks.0.qkv.layer_norm_weight"]
    )
    state["blocks.0.ln_1.weight"] = torch.ones(32)
    with pytest.raises(StateDictError, match="a second value"):
        load_plain_state_dict(model, state)


@pytest.mark.parametrize("which", ["some", "all"])
def test_extra_states_in_a_plain_load_are_reported(which: str) -> None:
    source = _converted(seed=1, trained=True)
    state = source.state_dict()
    if which == "some":
        del state["blocks.0.qkv._extra_state"]
    model = _converted(seed=2)
    before = snapshot(model)
    with pytest.raises(CheckpointError) as info:
        load_plain_state_dict(model, state)
    if which == "some":
        assert "for 8 of 9 FP8 modules" in info.value.found
        assert "none for blocks.0.qkv._extra_state" in info.value.found
    else:
        assert "every FP8 module" in info.value.found
        assert "fp8state.checkpoint.load_state_dict" in info.value.fix
    assert_unchanged(model, before)


def test_metadata_must_cover_every_module_when_strict() -> None:
    model = _converted(seed=1, trained=True)
    weights, metadata = to_plain_state_dict(model, fp8_metadata="separate")
    partial = {k: v for k, v in metadata.items() if not k.startswith("head.")}
    fresh = _converted(seed=2)
    before = snapshot(fresh)
    with pytest.raises(StateDictError) as info:
        load_plain_state_dict(fresh, weights, fp8_metadata=partial)
    assert [p.key for p in info.value.problems] == ["fp8_metadata[head._extra_state.*]"]
    assert_unchanged(fresh, before)
    load_plain_state_dict(fresh, weights, fp8_metadata=partial, strict=False)
    assert torch.equal(
        fresh.blocks[0].qkv.fp8_meta("fwd").scale, model.blocks[0].qkv.fp8_meta("fwd").scale
    )
    assert torch.equal(fresh.head.fp8_meta("fwd").scale, torch.ones(3))


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda m: m.update({"fwd.scale": torch.ones(3)}), "fp8_metadata['fwd.scale']"),
        (lambda m: m.update({"gone._extra_state.fwd.scale": torch.ones(3)}), "gone._extra_state"),
        (
            lambda m: m.__setitem__(
                "head._extra_state.fwd.scale", -m["head._extra_state.fwd.scale"]
            ),
            "head._extra_state",
        ),
    ],
    ids=["no-module-part", "unknown-module", "invalid-value"],
)
def test_bad_metadata_is_reported(edit: object, key: str) -> None:
    weights, metadata = to_plain_state_dict(_converted(trained=True), fp8_metadata="separate")
    edit(metadata)  # type: ignore[operator]
    model = _converted(seed=2)
    before = snapshot(model)
    with pytest.raises(StateDictError) as info:
        load_plain_state_dict(model, weights, fp8_metadata=metadata)
    assert any(p.key.startswith(key) for p in info.value.problems), info.value.problems
    assert_unchanged(model, before)


def test_not_a_mapping_is_refused() -> None:
    with pytest.raises(CheckpointError, match="a mapping"):
        load_plain_state_dict(_converted(), [("emb.weight", torch.zeros(1))])  # type: ignore[arg-type]


def test_a_model_never_converted_works_too() -> None:
    model = nn.Sequential(fp8state.Linear(16, 32), nn.ReLU(), fp8state.LayerNormMLP(32, 64))
    run_steps(model, 2)
    weights = to_plain_state_dict(model)
    assert sorted(weights) == [
        "0.bias",
        "0.weight",
        "2.fc1_bias",
        "2.fc1_weight",
        "2.fc2_bias",
        "2.fc2_weight",
        "2.layer_norm_bias",
        "2.layer_norm_weight",
    ]
    other = copy.deepcopy(model)
    run_steps(other, 2, seed=9)
    load_plain_state_dict(other, weights)
    x = torch.randn(2, 16)
    assert torch.equal(other(x), model(x))
    assert torch.equal(other[2].fp8_meta("fwd").scale, torch.ones(6))
