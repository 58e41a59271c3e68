"""An FP8-trained tiny Llama exported for serving, read back by the real compressed-tensors and
transformers packages on CPU: the config validates, decompression gives the dequantized FP8
weights bit for bit, and the loaded model's logits follow fp8state's FP8 forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _helpers.hf import tiny_llama_config

import fp8state
from fp8state import quantize
from fp8state.export import export_fp8

transformers = pytest.importorskip("transformers")
ct_quant = pytest.importorskip("compressed_tensors.quantization")
ct_compressors = pytest.importorskip("compressed_tensors.compressors")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _trained_llama(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(0)
    config = tiny_llama_config()
    source = tmp_path / "source"
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(source)
    (source / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    model = fp8state.convert_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16))
        with fp8state.fp8_autocast():
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, source


def test_compressed_tensors_reads_the_export_bit_for_bit(tmp_path: Path) -> None:
    model, source = _trained_llama(tmp_path)
    report = export_fp8(model, tmp_path / "out", copy_from=source)
    assert (tmp_path / "out" / "tokenizer_config.json").exists()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    quant = ct_quant.QuantizationConfig.model_validate(config["quantization_config"])
    assert quant.format == "float-quantized" and quant.quantization_status == "compressed"
    scheme = quant.config_groups["group_0"]
    assert scheme.weights.strategy == "tensor" and scheme.input_activations.dynamic is False
    tensors = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    compressor = ct_compressors.BaseCompressor.load_from_registry(quant.format)
    assert len(report.scales) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; lm_head
    for name in report.scales:
        local = {k: tensors[f"{name}.{k}"] for k in ("weight", "weight_scale", "input_scale")}
        decompressed = compressor.decompress(local, scheme)["weight"]
        mine = quantize.dequantize(local["weight"], local["weight_scale"], torch.float32)
        assert decompressed.dtype == torch.float32
        assert torch.equal(decompressed, mine), name


def test_transformers_loads_the_export_and_follows_the_fp8_forward(tmp_path: Path) -> None:
    model, _ = _trained_llama(tmp_path)
    export_fp8(model, tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.randint(0, 128, (2, 16))
    model.eval()
    with torch.no_grad():
        served = loaded(ids).logits.float()
        with fp8state.fp8_autocast():
            reference = model(ids).logits.float()
    # transformers decompresses the weights (the same FP8 values and scales) and runs its
    # activations unquantized on CPU, where fp8state's FP8 forward casts them to E4M3 too:
    # the difference is the activations' FP8 rounding.
    error = (served - reference).abs().max() / reference.abs().max()
    cosine = torch.nn.functional.cosine_similarity(served.flatten(), reference.flatten(), dim=0)
    assert error < 0.15 and cosine > 0.995, (float(error), float(cosine))


def test_transformers_loads_a_sharded_export_as_the_single_file(tmp_path: Path) -> None:
    model, _ = _trained_llama(tmp_path)
    export_fp8(model, tmp_path / "one")
    export_fp8(model, tmp_path / "shards", max_shard_bytes=64 * 1024)
    assert len(list((tmp_path / "shards").glob("model-*-of-*.safetensors"))) > 1
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        one = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one")(ids).logits
        shards = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "shards")
        assert torch.equal(shards(ids).logits, one)


def test_a_tied_lm_head_loads_from_python_and_from_the_cli(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = tiny_llama_config()
    config.tie_word_embeddings = True
    model = fp8state.convert_model(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 128, (2, 16))
    with fp8state.fp8_autocast():
        model(input_ids=ids, labels=ids).loss.backward()
    model.save_pretrained(tmp_path / "hf")  # drops the tied lm_head.weight, keeps its metadata
    from fp8state.cli import main

    report = export_fp8(model, tmp_path / "py")
    assert main(["export", str(tmp_path / "hf"), str(tmp_path / "cli")]) == 0
    model.eval()
    with torch.no_grad(), fp8state.fp8_autocast():
        reference = model(ids).logits.float()
    for out in ("py", "cli"):
        config_json = json.loads((tmp_path / out / "config.json").read_text())
        assert "lm_head" in config_json["quantization_config"]["ignore"]
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out)
        with torch.no_grad():
            served = loaded(ids).logits.float()
        error = (served - reference).abs().max() / reference.abs().max()
        assert error < 0.15, (out, float(error))
    assert "lm_head" in report.kept
