"""FP8 models through Hugging Face's and Accelerate's own checkpointing, with the real packages:
save_pretrained (sharded too) -> from_pretrained, plain models reading FP8 checkpoints, and
Accelerate's save_state/load_state with their defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _helpers.hf import hf_class, tiny_fp8_llama, tiny_fp8_model, to_fp8
from _helpers.state import assert_state_equal

import fp8state
from fp8state.errors import CheckpointError
from fp8state.integrations.huggingface import load_fp8_metadata

transformers = pytest.importorskip("transformers")


def _train(model: torch.nn.Module, steps: int, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        with fp8state.fp8_autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# Per architecture: the FP8 modules convert_model makes (Llama: 7 projections per layer and
# lm_head; GPT-2: 4 Conv1D per layer and lm_head, tied to the embedding).
FP8_MODULES = {"llama": 2 * 7 + 1, "gpt2": 2 * 4 + 1}


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def trained(arch: str) -> torch.nn.Module:
    model = tiny_fp8_model(arch, seed=0)
    _train(model, 3)
    return model


@pytest.mark.parametrize("shard", [None, "60KB"], ids=["one-file", "sharded"])
def test_save_pretrained_round_trip_restores_fp8_metadata_bit_for_bit(
    arch: str, trained: torch.nn.Module, tmp_path: Path, shard: str | None
) -> None:
    kwargs = {} if shard is None else {"max_shard_size": shard}
    trained.save_pretrained(tmp_path, **kwargs)
    assert (len(list(tmp_path.glob("*.safetensors"))) > 1) == (shard is not None)
    again = to_fp8(hf_class(arch).from_pretrained(tmp_path))
    restored = load_fp8_metadata(again, tmp_path)
    assert len(restored) == FP8_MODULES[arch]
    assert_state_equal(again, trained)
    for key, value in trained.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    # And it trains on exactly as the saved model does (dropout too: the same seed for both).
    twin = to_fp8(hf_class(arch).from_pretrained(tmp_path))
    load_fp8_metadata(twin, tmp_path)
    torch.manual_seed(3)
    losses = _train(again, 2, seed=1)
    torch.manual_seed(3)
    assert losses == _train(twin, 2, seed=1)


def test_a_plain_model_reads_the_weights_of_an_fp8_checkpoint(
    arch: str, trained: torch.nn.Module, tmp_path: Path
) -> None:
    trained.save_pretrained(tmp_path)
    plain, info = hf_class(arch).from_pretrained(tmp_path, output_loading_info=True)
    assert not any(isinstance(m, fp8state.FP8StateMixin) for m in plain.modules())
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert all(k.endswith("._extra_state") for k in info["unexpected_keys"])
    assert len(info["unexpected_keys"]) == FP8_MODULES[arch]
    weights = {k: v for k, v in trained.state_dict().items() if not k.endswith("_extra_state")}
    for key, value in plain.state_dict().items():
        assert torch.equal(value, weights[key]), key


def test_missing_metadata_is_an_error_and_changes_nothing(
    arch: str, trained: torch.nn.Module, tmp_path: Path
) -> None:
    plain = hf_class(arch)(trained.config)
    plain.load_state_dict(
        {k: v for k, v in trained.state_dict().items() if not k.endswith("_extra_state")}
    )
    plain.save_pretrained(tmp_path)  # a plain checkpoint: no FP8 metadata at all
    model = to_fp8(hf_class(arch).from_pretrained(tmp_path))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="no FP8 metadata"):
        load_fp8_metadata(model, tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_accelerate_save_state_and_load_state_resume_bit_for_bit(tmp_path: Path) -> None:
    accelerate = pytest.importorskip("accelerate")

    def setup(seed: int):
        model = tiny_fp8_llama(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        acc = accelerate.Accelerator(cpu=True)
        model, opt = acc.prepare(model, opt)
        return acc, model, opt

    def steps(acc, model, opt, n: int, seed: int) -> list[float]:
        gen = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(n):
            ids = torch.randint(0, 128, (2, 16), generator=gen)
            with fp8state.fp8_autocast():
                loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    acc, model, opt = setup(0)
    first = steps(acc, model, opt, 2, seed=1)
    acc.save_state(str(tmp_path / "state"))  # defaults: safetensors for the model
    rest = steps(acc, model, opt, 2, seed=2)
    acc2, model2, opt2 = setup(5)  # other initial weights: everything must come from the files
    acc2.load_state(str(tmp_path / "state"))
    assert steps(acc2, model2, opt2, 2, seed=2) == rest
    assert first  # the first steps ran in FP8 too
    assert_state_equal(model2, model)
    acc.save_model(model, str(tmp_path / "model"))  # Accelerate's save_model, also default
    assert list((tmp_path / "model").glob("*.safetensors"))
