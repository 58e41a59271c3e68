"""Plain checkpoints as files: tied weights in every direction, paths that are not safetensors
files, and the arguments of the plain loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from _helpers.state import assert_same, assert_unchanged, snapshot
from _helpers.tiny_lm import TinyLM, tiny_lm, tokens
from _helpers.tiny_lm import converted_tiny_lm as _converted

from fp8state.checkpoint import (
    StateDictError,
    load_plain_state_dict,
    load_safetensors,
    save_safetensors,
    to_plain_state_dict,
)
from fp8state.errors import CheckpointError, ConfigError


# ------------------------------------------------------------------------ tied weights
def test_a_hugging_face_style_file_without_the_tied_key_loads(tmp_path: Path) -> None:
    plain = tiny_lm(seed=4)
    st.save_model(plain, str(tmp_path / "hf.safetensors"))  # drops head.weight, as HF does
    assert "head.weight" not in st.load_file(tmp_path / "hf.safetensors")
    model = _converted(seed=1, trained=True)
    result = load_safetensors(model, tmp_path / "hf.safetensors")
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert model.head.weight is model.emb.weight  # the tie is kept
    assert torch.equal(model(tokens()), plain(tokens()))


def test_save_safetensors_follows_save_model_and_load_model_reads_it(tmp_path: Path) -> None:
    model = _converted(seed=1, trained=True)
    save_safetensors(model, tmp_path / "ours.safetensors")
    plain = tiny_lm(seed=1)
    st.save_model(plain, str(tmp_path / "theirs.safetensors"))
    ours = st.load_file(tmp_path / "ours.safetensors")
    assert sorted(ours) == sorted(st.load_file(tmp_path / "theirs.safetensors"))
    fresh = TinyLM()
    missing, unexpected = st.load_model(fresh, str(tmp_path / "ours.safetensors"))
    assert not missing and not unexpected
    assert fresh.head.weight is fresh.emb.weight
    assert torch.equal(fresh(tokens()), model(tokens()))
    # A dict for load_state_dict(strict=True) keeps both names.
    assert {"emb.weight", "head.weight"} <= set(to_plain_state_dict(model))


def test_own_save_and_load_round_trip_exactly_with_ties(tmp_path: Path) -> None:
    model = _converted(seed=1, trained=True)
    save_safetensors(
        model, tmp_path / "w.safetensors", fp8_metadata_path=tmp_path / "fp8.safetensors"
    )
    fresh = _converted(seed=2)
    assert (
        load_safetensors(
            fresh, tmp_path / "w.safetensors", True, fp8_metadata_path=tmp_path / "fp8.safetensors"
        ).missing_keys
        == []
    )
    assert_same(fresh.state_dict(), model.state_dict())
    assert fresh.head.weight is fresh.emb.weight


def test_the_tie_fills_only_what_it_ties() -> None:
    model = _converted(seed=1)
    state = tiny_lm(seed=5).state_dict()
    del state["head.weight"]
    load_plain_state_dict(model, state)  # filled from emb.weight
    assert torch.equal(model.head.weight, state["emb.weight"])
    del state["emb.weight"]  # both names gone: both are missing
    before = snapshot(model)
    with pytest.raises(StateDictError) as info:
        load_plain_state_dict(model, state)
    assert sorted(p.key for p in info.value.problems) == ["emb.weight", "head.weight"]
    assert_unchanged(model, before)
    result = load_plain_state_dict(model, state, False)
    assert sorted(result.missing_keys) == ["emb.weight", "head.weight"]


def test_a_bad_tied_value_is_reported_once() -> None:
    model = _converted(seed=1)
    state = tiny_lm(seed=5).state_dict()
    del state["head.weight"]
    state["emb.weight"] = torch.zeros(3, 3)
    with pytest.raises(StateDictError) as info:
        load_plain_state_dict(model, state)
    assert [p.key for p in info.value.problems] == ["emb.weight"]
    result = load_plain_state_dict(
        model, {k: v for k, v in state.items() if k != "emb.weight"}, strict=False
    )
    assert sorted(result.missing_keys) == ["emb.weight", "head.weight"]


# -------------------------------------------------------------- paths that are not weights
@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    model = _converted(seed=1, trained=True)
    save_safetensors(
        model, tmp_path / "w.safetensors", fp8_metadata_path=tmp_path / "fp8.safetensors"
    )
    torch.save(model.state_dict(), tmp_path / "model.pt")
    weights = to_plain_state_dict(model)
    keys = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": keys[:10],
        "model-00002-of-00002.safetensors": keys[10:],
    }
    (tmp_path / "hf").mkdir()
    for name, shard_keys in shards.items():
        st.save_file({k: weights[k] for k in shard_keys}, tmp_path / "hf" / name)
    index = {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    truncated = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(truncated[: len(truncated) // 2])
    return {
        "dir": tmp_path / "hf",
        "index": tmp_path / "hf" / "model.safetensors.index.json",
        "pt": tmp_path / "model.pt",
        "weights": tmp_path / "w.safetensors",
        "fp8": tmp_path / "fp8.safetensors",
        "missing": tmp_path / "nope.safetensors",
        "truncated": tmp_path / "truncated.safetensors",
    }


@pytest.mark.parametrize(
    ("path", "found", "fix"),
    [
        ("dir", "a folder holding model-00001-of-00002.safetensors", "shard files"),
        ("index", "a JSON file", "model-00002-of-00002.safetensors']"),
        ("pt", "a torch.save file", "fp8state.checkpoint.load(path)"),
        ("fp8", "the FP8 metadata file", "fp8_metadata_path="),
        ("missing", "no such file", "Check the path"),
        ("truncated", "cannot be read", "copy it again"),
    ],
)
def test_what_is_not_a_weights_file_is_named(
    files: dict[str, Path], path: str, found: str, fix: str
) -> None:
    model = _converted(seed=2)
    before = snapshot(model)
    with pytest.raises(CheckpointError) as info:
        load_safetensors(model, files[path])
    assert info.value.key == str(files[path])
    assert found in info.value.found and fix in info.value.fix
    assert_unchanged(model, before)


def test_the_shards_the_index_lists_load(files: dict[str, Path]) -> None:
    model = _converted(seed=2)
    load_safetensors(model, sorted(files["dir"].glob("*.safetensors")))
    reference = _converted(seed=1, trained=True)
    assert torch.equal(model(tokens()), reference(tokens()))


def test_a_weights_file_as_metadata_is_named(files: dict[str, Path]) -> None:
    model = _converted(seed=2)
    with pytest.raises(CheckpointError) as info:
        load_safetensors(model, files["weights"], fp8_metadata_path=files["weights"])
    assert "a weights file?" in info.value.found
    assert "fp8_metadata_path" in info.value.fix


def test_save_refuses_a_folder_and_one_file_for_both(tmp_path: Path) -> None:
    model = _converted()
    with pytest.raises(CheckpointError, match="a folder"):
        save_safetensors(model, tmp_path)
    with pytest.raises(CheckpointError, match="the same file"):
        save_safetensors(
            model, tmp_path / "a.safetensors", fp8_metadata_path=tmp_path / "a.safetensors"
        )
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------- arguments
def test_fp8_metadata_of_the_wrong_type_names_the_type() -> None:
    model = _converted()
    weights, metadata = to_plain_state_dict(model, fp8_metadata="separate")
    with pytest.raises(ConfigError) as info:
        load_plain_state_dict(model, weights, fp8_metadata=list(metadata.values()))  # type: ignore[arg-type]
    assert info.value.found == "a list"
    with pytest.raises(ConfigError) as info:
        load_plain_state_dict(model, weights, fp8_metadata="separate")  # type: ignore[arg-type]
    assert "a mode of to_plain_state_dict" in info.value.found
    with pytest.raises(ConfigError) as info:
        to_plain_state_dict(model, fp8_metadata=metadata)  # type: ignore[call-overload]
    assert info.value.found == "a dict" and "tensor(" not in str(info.value)


def test_strict_is_positional_as_in_load_state_dict() -> None:
    model = _converted(seed=1)
    state = tiny_lm(seed=5).state_dict()
    state["decoder.weight"] = torch.zeros(2)
    assert load_plain_state_dict(model, state, False).unexpected_keys == ["decoder.weight"]
    with pytest.raises(TypeError):
        load_safetensors(model, "w.safetensors", metadata_path="m")  # type: ignore[call-arg]


def test_metadata_errors_never_advise_strict_false() -> None:
    model = _converted(seed=1, trained=True)
    weights, metadata = to_plain_state_dict(model, fp8_metadata="separate")
    partial = {k: v for k, v in metadata.items() if not k.startswith("head.")}
    with pytest.raises(StateDictError) as info:
        load_plain_state_dict(_converted(seed=2), weights, fp8_metadata=partial)
    assert "strict=False" not in str(info.value)
    assert "no fp8_metadata at all" in info.value.problems[0].fix
