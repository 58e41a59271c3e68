"""``fp8state export`` from a Hugging Face folder, a torch.save file and a DCP folder, and
``fp8state inspect`` of the result; GPT-2's Conv1D layers refused rather than transposed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers.hf import tiny_llama_config

import fp8state
from fp8state.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _trained(model: torch.nn.Module, vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = fp8state.convert_model(model)
    ids = torch.randint(0, vocab, (2, 16))
    with fp8state.fp8_autocast():
        model(input_ids=ids, labels=ids).loss.backward()
    return model


def _llama(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    model = _trained(transformers.LlamaForCausalLM(tiny_llama_config()), 128)
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


def test_export_from_each_source_then_inspect(tmp_path: Path, capsys) -> None:
    model, hf = _llama(tmp_path)
    assert main(["export", str(hf), str(tmp_path / "a")]) == 0
    assert "wrote" in capsys.readouterr().out
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    assert (
        main(["export", str(tmp_path / "ckpt.pt"), str(tmp_path / "b"), "--config", str(hf)]) == 0
    )
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert main(["export", str(tmp_path / "dcp"), str(tmp_path / "c"), "--config", str(hf)]) == 0
    files = [(tmp_path / d / "model.safetensors").read_bytes() for d in "abc"]
    assert files[0] == files[1] == files[2]
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "15 FP8 layers" in out and "model.layers.0.self_attn.q_proj" in out
    assert "model.embed_tokens" in out.splitlines()[-1]


def test_refusals_are_one_line_and_write_nothing(tmp_path: Path, capsys) -> None:
    model, hf = _llama(tmp_path)
    (tmp_path / "out").mkdir()
    capsys.readouterr()
    assert main(["export", str(hf), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    assert main(["export", str(tmp_path / "ckpt.pt"), str(tmp_path / "new")]) == 1
    assert "--config" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_gpt2_conv1d_layers_are_refused_not_transposed(tmp_path: Path, capsys) -> None:
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    model = _trained(transformers.GPT2LMHeadModel(config), 64)
    model.save_pretrained(tmp_path / "gpt2")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "gpt2"), str(tmp_path / "out")]) == 1
    assert "not an nn.Linear" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_sharded_hugging_face_folder_is_read_through_its_index(tmp_path: Path) -> None:
    model, hf = _llama(tmp_path)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    (tmp_path / "sharded" / "stale.safetensors").write_bytes(b"not read")  # not in the index
    assert main(["export", str(hf), str(tmp_path / "a")]) == 0
    assert main(["export", str(tmp_path / "sharded"), str(tmp_path / "b")]) == 0
    a, b = ((tmp_path / d / "model.safetensors").read_bytes() for d in "ab")
    assert a == b
