"""Whole-checkpoint conversion: structure kept, GEMM counts from parameter names, fp8state
payloads kept, strict and lenient handling, the report."""

from __future__ import annotations

import io
import json
from collections import OrderedDict
from typing import Any

import pytest
import torch
from _helpers.state import fields
from te_gen import Module, Spec, build, extra_state, save

import fp8state
from fp8state.errors import LegacyFormatError, SchemaError
from fp8state.migrate import (
    convert_te_state_dict,
    infer_num_gemms,
    load_te_checkpoint,
    migrate_te_checkpoint,
)

M = torch.ones(2, 2)
V = torch.ones(2)


@pytest.mark.parametrize(
    ("members", "gemms"),
    [
        ({"weight": M, "bias": V}, 1),  # Linear
        ({"weight": M}, 1),  # Linear without bias
        ({"layer_norm_weight": V, "layer_norm_bias": V, "weight": M, "bias": V}, 1),
        ({"layer_norm_weight": V, "query_weight": M, "key_weight": M, "value_weight": M}, 1),
        ({"layer_norm_weight": V, "layer_norm_bias": V}, 1),  # TE v0.1-v0.5 layernorm_qkv
        ({"layer_norm_weight": V, "fc1_weight": M, "fc1_bias": V, "fc2_weight": M}, 2),
        ({"weight0": M, "weight1": M, "weight2": M, "bias0": V}, 3),  # GroupedLinear
        ({"weight": V, "bias": V}, None),  # LayerNorm
        ({"weight": V}, None),  # RMSNorm
        ({}, None),  # DotProductAttention
    ],
)
def test_infer_num_gemms(members: dict[str, Any], gemms: int | None) -> None:
    assert infer_num_gemms({**members, "_extra_state": None}) == gemms


def _linear_sd(era: str = "E08", **spec: Any) -> OrderedDict[str, Any]:
    return build(
        era, [Module("net.0.", "Linear", spec=Spec(**spec)), Module("net.1.", "LayerNorm")]
    ).state_dict


@pytest.mark.parametrize("wrap", [None, "model", "state_dict", "module"])
def test_structure_is_kept(wrap: str | None, tmp_path: Any) -> None:
    gen = build("E06", [Module("net.0.", "Linear"), Module("net.1.", "LayerNormMLP")])
    saved = save(gen, tmp_path / "ck.pt", wrap=wrap)
    out, report = migrate_te_checkpoint(tmp_path / "ck.pt")
    assert type(out) is type(saved) and list(out) == list(saved)
    assert report.state_dicts == [wrap or ""]
    sd = out[wrap] if wrap else out
    assert isinstance(sd, OrderedDict) and sd._metadata == gen.state_dict._metadata
    assert fields(sd["net.1._extra_state"])["fwd.scale"].shape == (6,)


def test_every_known_state_dict_key_is_converted() -> None:
    a, b = _linear_sd(), _linear_sd("E03")
    buf = io.BytesIO()
    torch.save({"model": a, "module": b, "step": 3}, buf)
    buf.seek(0)
    out, report = migrate_te_checkpoint(buf)
    assert report.state_dicts == ["model", "module"] and out["step"] == 3
    assert {e.key.split("/")[0] for e in report.entries} == {"model", "module"}
    assert all(isinstance(out[k]["net.0._extra_state"], torch.Tensor) for k in ("model", "module"))


@pytest.mark.parametrize("obj", [[1, 2], {"optimizer": {"lr": 1}}, {}, torch.ones(3)])
def test_no_state_dict_is_an_error(obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    with pytest.raises(LegacyFormatError, match="no state dict"):
        load_te_checkpoint(buf)


def test_fp8state_payloads_are_kept_and_validated() -> None:
    linear = fp8state.Linear(8, 12)
    sd = OrderedDict(linear.state_dict(prefix="ours."))
    sd.update(_linear_sd())
    out, report = convert_te_state_dict(sd)
    assert out["ours._extra_state"] is sd["ours._extra_state"]  # kept as it is
    actions = {e.key: (e.action, e.era) for e in report.entries}
    assert actions["ours._extra_state"] == ("kept", "fp8state schema v2")
    assert actions["net.0._extra_state"][0] == "converted"
    sd["ours._extra_state"] = dict(fields(sd["ours._extra_state"]), **{"fwd.scale": torch.ones(6)})
    with pytest.raises(SchemaError, match=r"^ours\._extra_state\['fwd.scale_inv'\]"):
        convert_te_state_dict(sd)
    out, report = convert_te_state_dict(sd, strict=False)
    assert "ours._extra_state" not in out and report.counts()["failed"] == 1


def test_gemm_count_from_parameters_is_cross_checked() -> None:
    value, _ = extra_state("E09", Spec(num_gemms=2))  # an MLP's state under a Linear's names
    sd = {"fc.weight": torch.ones(4, 4), "fc._extra_state": value}
    with pytest.raises(LegacyFormatError, match=r"^fc\._extra_state: found FP8 metadata for 2"):
        convert_te_state_dict(sd)


def test_report_text_and_json() -> None:
    sd = _linear_sd("E01", rows=3)
    sd["head.weight"] = torch.ones(3, 3)
    sd["head._extra_state"] = None
    _, report = convert_te_state_dict(sd)
    text = report.format_text()
    assert "converted net.0._extra_state | [E01, list]" in text
    assert "defaulted recipe fields: fp8_format, margin, amax_compute_algo" in text
    assert "default   head._extra_state" in text
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["counts"] == {"converted": 1, "default": 1}
    (entry,) = [e for e in doc["entries"] if e["action"] == "converted"]
    assert entry["te_slots"] == [2, 1] and entry["recipe"]["amax_history_len"] == 3
    assert report.summary().endswith("5 other tensors unchanged")


def test_progress_wrapper_sees_every_key() -> None:
    sd = _linear_sd()
    seen: list[int] = []

    def progress(keys: Any, total: int) -> Any:
        seen.append(total)
        return keys

    convert_te_state_dict(sd, progress=progress)
    assert seen == [len(sd)]


@pytest.mark.parametrize("era", ["E01", "E04", "E06", "E09"])
def test_legacy_torch_save_format_and_other_gpu_tags(era: str) -> None:
    from te_gen.tepickle import saved_on

    gen = build(era, [Module("a.", "Linear"), Module("b.", "LayerNormMLP")])
    params = [v for k, v in gen.state_dict.items() if not k.endswith("_extra_state")]
    buf = io.BytesIO()
    with saved_on("cuda:3", params), saved_on("cuda:0", gen.on_gpu):
        torch.save(gen.state_dict, buf, _use_new_zipfile_serialization=False)  # pre-1.6 format
    buf.seek(0)
    out, report = migrate_te_checkpoint(buf)
    assert [e.action for e in report.entries] == ["converted", "converted"]
    assert all("cuda:3" in e.locations for e in report.entries)
    for key in ("a.weight", "b.fc2_weight"):
        assert out[key].device.type == "cpu" and torch.equal(out[key], gen.state_dict[key])
