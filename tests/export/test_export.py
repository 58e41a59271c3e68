"""export_fp8 on plain fp8state models: what each file holds, how every scale is computed (as
the recipe computes it in training), the options, and each refusal leaving nothing written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import fp8state
from fp8state import quantize, scaling
from fp8state.errors import ConfigError, ExportError
from fp8state.export import (
    Architecture,
    describe_export,
    export_fp8,
    export_state_dict,
    read_export,
)
from fp8state.slots import FwdSlot, fwd_slot


def _trained(steps: int = 3, algo: str = "max") -> nn.Sequential:
    torch.manual_seed(0)
    recipe = fp8state.DelayedScaling(amax_history_len=8, amax_compute_algo=algo, margin=1)
    model = nn.Sequential(
        fp8state.Linear(32, 64), nn.GELU(), fp8state.LayerNormMLP(64, 32), nn.Linear(64, 16)
    )
    model[0].fp8_recipe = model[2].fp8_recipe = recipe
    for step in range(steps):
        x = torch.randn(8, 32) * (step + 1)
        with fp8state.fp8_autocast(fp8_recipe=recipe):
            model(x).sum().backward()
    return model


def _nothing_written(out: Path) -> bool:
    return not out.exists() and not [p for p in out.parent.iterdir() if ".tmp" in p.name]


def test_files_hold_fp8_weights_scales_and_the_rest_in_training_dtype(tmp_path: Path) -> None:
    model = _trained()
    report = export_fp8(model, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert set(report.scales) == {"0", "2.fc1", "2.fc2"}
    for name in report.scales:
        assert tensors[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert tensors[f"{name}.weight_scale"].shape == (1,) == tensors[f"{name}.input_scale"].shape
    assert tensors["2.fc1.bias"].dtype == torch.float32 and "2.fc1_bias" not in tensors
    assert torch.equal(tensors["3.weight"], model[3].weight.detach())  # nn.Linear: untouched
    assert not [k for k in tensors if "_extra_state" in k]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == ["3"]  # the nn.Linear left as it was
    assert read_export(tmp_path / "out") == config["quantization_config"]
    assert read_export(tmp_path) is None


def test_weight_scale_comes_from_the_weight_as_the_recipe_computes_it(tmp_path: Path) -> None:
    model = _trained()
    export_fp8(model, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    weight = model[0].weight.detach()
    scale = scaling.scale_from_amax(weight.abs().amax().reshape(1), torch.ones(1), 448.0, 1)
    assert torch.equal(tensors["0.weight_scale"], torch.reciprocal(scale))
    expected = quantize.quantize(weight, scale, torch.float8_e4m3fn)
    assert torch.equal(tensors["0.weight"].view(torch.uint8), expected.view(torch.uint8))
    # compressed-tensors' dequantization (FP8 value times the stored scale) in float32:
    back = quantize.dequantize(tensors["0.weight"], tensors["0.weight_scale"], torch.float32)
    # E4M3 keeps 3 mantissa bits (relative error <= 2**-4), subnormals step by 2**-9.
    bound = weight.abs() * 2**-4 + tensors["0.weight_scale"] * 2**-9
    assert bool(((back - weight).abs() <= bound).all())


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_input_scale_is_the_recipes_next_scale(tmp_path: Path, algo: str) -> None:
    model = _trained(algo=algo)
    report = export_fp8(model, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    for name, module, gemm in (("0", model[0], 0), ("2.fc1", model[2], 0), ("2.fc2", model[2], 1)):
        slot = fwd_slot(gemm, FwdSlot.INPUT)
        # The scales update at the end of each step: the stored scale_inv is the recipe's.
        stored = module.fp8_meta("fwd").scale_inv[slot : slot + 1]
        assert torch.equal(tensors[f"{name}.input_scale"], stored)
        assert report.scales[name][1] == stored.item()


def test_window_and_percentile_options(tmp_path: Path) -> None:
    model = _trained(steps=4)
    history = model[0].fp8_meta("fwd").amax_history[:, 0]
    export_fp8(model, tmp_path / "w1", window=1)
    export_fp8(model, tmp_path / "p50", percentile=50)
    one = load_file(tmp_path / "w1" / "model.safetensors")["0.input_scale"]
    half = load_file(tmp_path / "p50" / "model.safetensors")["0.input_scale"]
    assert torch.equal(one, (history[0] / 448.0 * 2).reshape(1)) or torch.allclose(
        one, (history[0] * 2 / 448.0).reshape(1), rtol=1e-7, atol=0
    )
    median = torch.quantile(history[history > 0].double(), 0.5).float()
    assert torch.allclose(half, (median * 2 / 448.0).reshape(1), rtol=1e-6, atol=0)
    with pytest.raises(ConfigError, match="percentile"):
        export_fp8(model, tmp_path / "bad", percentile=0)
    with pytest.raises(ConfigError, match="format"):
        export_fp8(model, tmp_path / "bad", format="gguf")


def test_module_never_run_in_fp8_is_refused_and_nothing_written(tmp_path: Path) -> None:
    model = nn.Sequential(fp8state.Linear(32, 32))
    with pytest.raises(ExportError, match="empty forward input amax history") as caught:
        export_fp8(model, tmp_path / "out")
    assert caught.value.key == "0"
    assert _nothing_written(tmp_path / "out")
    with pytest.raises(ExportError, match="no layer to convert"):  # left out: nothing left
        export_fp8(model, tmp_path / "out", exclude=["0"])


def test_non_finite_weight_and_zero_scale_are_refused(tmp_path: Path) -> None:
    model = _trained(algo="most_recent")
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(ExportError, match="inf or NaN"):
        export_fp8(model, tmp_path / "out")
    model = _trained(algo="most_recent")
    meta = model[0].fp8_meta("fwd")
    meta.amax_history[0, 0] = 0.0  # the newest row empty: the recipe keeps the stored scale
    meta.scale[0] = 0.0
    with pytest.raises(ExportError, match="invalid value.*0.0") as caught:
        export_fp8(model, tmp_path / "out")
    assert caught.value.key == "0"
    assert _nothing_written(tmp_path / "out")


def test_shapes_fp8_gemms_cannot_take_are_refused(tmp_path: Path) -> None:
    model = nn.Sequential(fp8state.Linear(24, 32))
    with fp8state.fp8_autocast():
        model(torch.randn(4, 24)).sum().backward()
    with pytest.raises(ExportError, match="multiples of 16"):
        export_fp8(model, tmp_path / "out")
    assert _nothing_written(tmp_path / "out")


def test_existing_folder_needs_overwrite_and_is_replaced_whole(tmp_path: Path) -> None:
    model = _trained()
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(ExportError, match="existing folder"):
        export_fp8(model, out)
    assert (out / "old.txt").exists()
    export_fp8(model, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def _architecture(model: nn.Module, linears: set[str]) -> Architecture:
    keys = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    return Architecture(frozenset(linears), frozenset(keys))


def test_state_dict_export_refuses_what_the_architecture_does_not_have(tmp_path: Path) -> None:
    model = _trained()
    state = model.state_dict()
    with pytest.raises(ExportError, match="not an nn.Linear"):
        export_state_dict(
            state, tmp_path / "out", config={}, architecture=_architecture(model, {"0"})
        )
    with pytest.raises(ExportError, match="does not have"):
        export_state_dict(
            {"extra.weight": torch.ones(2), **state},
            tmp_path / "out",
            config={},
            architecture=_architecture(model, {"0", "2.fc1", "2.fc2", "3"}),
        )
    assert _nothing_written(tmp_path / "out")
    report = export_state_dict(
        state,
        tmp_path / "out",
        config={"model_type": "x"},
        architecture=_architecture(model, {"0", "2.fc1", "2.fc2", "3"}),
    )
    direct = export_fp8(model, tmp_path / "direct")
    assert report.scales == direct.scales and report.ignored == direct.ignored == ["3"]
    a = load_file(tmp_path / "out" / "model.safetensors")
    b = load_file(tmp_path / "direct" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k].float(), b[k].float()) for k in a)


def test_a_root_level_layer_exports_under_plain_names(tmp_path: Path) -> None:
    model = fp8state.Linear(32, 32)
    with fp8state.fp8_autocast():
        model(torch.randn(4, 32))
    report = export_fp8(model, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert set(report.scales) == {""}
    assert sorted(tensors) == ["bias", "input_scale", "weight", "weight_scale"]


def test_bad_targets_and_configs_are_refused_before_writing(tmp_path: Path) -> None:
    model = _trained()
    with pytest.raises(ExportError, match="no parent folder"):
        export_fp8(model, tmp_path / "missing" / "out")
    with pytest.raises(ExportError, match="JSON"):
        export_fp8(model, tmp_path / "out", config={"x": object()})
    assert _nothing_written(tmp_path / "out")


def test_errors_of_a_fused_mlp_name_the_layer(tmp_path: Path) -> None:
    model = _trained()
    with torch.no_grad():
        model[2].fc2_weight[0, 0] = float("inf")
    with pytest.raises(ExportError, match="inf or NaN") as caught:
        export_fp8(model, tmp_path / "out")
    assert caught.value.key == "2.fc2"


def test_large_exports_are_sharded_with_an_index(tmp_path: Path) -> None:
    model = _trained()
    export_fp8(model, tmp_path / "one")
    export_fp8(model, tmp_path / "shards", max_shard_bytes=4096)
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / "shards" / "model.safetensors").exists()
    one = load_file(tmp_path / "one" / "model.safetensors")
    merged: dict[str, torch.Tensor] = {}
    for name in files:
        merged.update(load_file(tmp_path / "shards" / name))
    assert index["weight_map"] == {k: n for n in files for k in load_file(tmp_path / "shards" / n)}
    assert sorted(merged) == sorted(one)
    assert all(torch.equal(merged[k].view(torch.uint8), one[k].view(torch.uint8)) for k in one)
    total = sum(t.numel() * t.element_size() for t in one.values())
    assert index["metadata"]["total_size"] == total
    assert describe_export(str(tmp_path / "shards"), read_export(tmp_path / "shards")) == (
        describe_export(str(tmp_path / "one"), read_export(tmp_path / "one"))
    )
    with pytest.raises(ConfigError, match="max_shard_bytes"):
        export_fp8(model, tmp_path / "bad", max_shard_bytes=0)


def test_an_index_naming_files_outside_the_folder_is_refused(tmp_path: Path) -> None:
    model = _trained()
    export_fp8(model, tmp_path / "out", max_shard_bytes=4096)
    index_path = tmp_path / "out" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["0.weight"] = "../../etc/passwd"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ExportError, match="outside the folder"):
        describe_export(str(tmp_path / "out"), read_export(tmp_path / "out"))


def test_wrapped_models_export_under_plain_names(tmp_path: Path) -> None:
    model = _trained()
    plain = export_fp8(model, tmp_path / "plain")
    compiled = export_fp8(torch.compile(model), tmp_path / "compiled")
    assert compiled.scales == plain.scales and compiled.ignored == plain.ignored
    a = load_file(tmp_path / "plain" / "model.safetensors")
    b = load_file(tmp_path / "compiled" / "model.safetensors")
    assert sorted(a) == sorted(b)


def test_a_fused_layernorm_linear_exports_under_the_original_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64))
    fp8state.convert_model(model, layernorm_linear=[("0", "1")])
    with fp8state.fp8_autocast():
        model(torch.randn(8, 32)).sum().backward()
    report = export_fp8(model, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert set(report.scales) == {"1"}
    assert sorted(tensors) == [
        "0.bias",
        "0.weight",
        "1.bias",
        "1.input_scale",
        "1.weight",
        "1.weight_scale",
    ]


def test_a_tied_layer_stays_in_the_training_dtype(tmp_path: Path) -> None:
    torch.manual_seed(0)
    embed, head = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head, "proj": nn.Linear(32, 32)})
    fp8state.convert_model(model)
    with fp8state.fp8_autocast():
        x = model["embed"](torch.randint(0, 64, (8,)))
        model["head"](model["proj"](x)).sum().backward()
    report = export_fp8(model, tmp_path / "out")
    assert set(report.scales) == {"proj"} and "head" in report.kept
    assert "head" in report.ignored
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert tensors["head.weight"].dtype == torch.float32


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    model = _trained()
    with pytest.raises(ConfigError, match="exclude"):
        export_fp8(model, tmp_path / "out", exclude="0")
    with pytest.raises(ConfigError, match="percentile"):
        export_fp8(model, tmp_path / "out", percentile=True)
    with pytest.raises(ExportError, match="no layer to convert"):
        export_fp8(nn.Sequential(nn.Linear(16, 16)), tmp_path / "out")
    assert _nothing_written(tmp_path / "out")
