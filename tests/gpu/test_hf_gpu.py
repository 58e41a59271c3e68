"""Hugging Face on a GPU: a tiny bf16 Llama trained with ``torch._scaled_mm`` (where the GPU has
FP8 tensor cores), through ``save_pretrained`` -> ``from_pretrained`` -> ``load_fp8_metadata``
and through ``Trainer``'s resume: every weight and FP8 buffer back bit for bit, on the GPU the
model lives on, and training goes on exactly as before. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _helpers.hf import tiny_llama_config, to_fp8
from _helpers.state import assert_state_equal

import fp8state
from fp8state.backends import resolve_backend
from fp8state.integrations.huggingface import load_fp8_metadata

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
# Eager attention: its backward is deterministic, so two runs can be compared bit for bit.
ATTENTION = "eager"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_llama_config()
    config._attn_implementation = ATTENTION
    # bf16 weights as from_pretrained gives them: `.to(torch.bfloat16)` would also round the
    # rotary frequencies (a float32 buffer outside the state dict) and change every output.
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return to_fp8(model.to(CUDA))


def _train(model: torch.nn.Module, steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=gen).to(CUDA)
        with fp8state.fp8_autocast():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def test_save_pretrained_round_trip_on_the_gpu_is_bit_exact(tmp_path: Path) -> None:
    model = _model(0)
    _train(model, 3, seed=0)
    backend = resolve_backend("auto", CUDA)
    fp8_modules = [m for m in model.modules() if isinstance(m, fp8state.FP8StateMixin)]
    assert len(fp8_modules) == 15
    assert all(m.fp8_last_gemm_backend == backend for m in fp8_modules)
    model.save_pretrained(tmp_path)
    again = to_fp8(
        transformers.LlamaForCausalLM.from_pretrained(
            tmp_path, device_map="cuda", attn_implementation=ATTENTION
        )
    )
    assert len(load_fp8_metadata(again, tmp_path)) == 15
    for name, value in [*again.named_parameters(), *again.named_buffers()]:
        assert value.device.type == "cuda", name  # FP8 buffers too: restored on its device
    assert_state_equal(again, model)
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key].cpu(), value.cpu()), key
    assert all(
        torch.equal(a, b) for a, b in zip(_train(model, 2, 1), _train(again, 2, 1), strict=True)
    )


def test_trainer_resume_on_the_gpu_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    rows = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(7))
    data = [{"input_ids": r, "labels": r} for r in rows]

    def run(seed: int, out: Path, resume: str | None) -> tuple[torch.nn.Module, list]:
        model = fp8state.autocast_forward(_model(seed))
        losses: list[torch.Tensor] = []
        model.register_forward_hook(lambda _m, _a, o: losses.append(o.loss.detach().clone()))
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=4, save_steps=2, per_device_train_batch_size=2,
            learning_rate=1e-3, report_to=[], seed=0, data_seed=0, disable_tqdm=True,
        )  # fmt: skip
        transformers.Trainer(model=model, args=args, train_dataset=data).train(
            resume_from_checkpoint=resume
        )
        return model, losses

    whole, whole_losses = run(0, tmp_path / "whole", None)
    resumed, resumed_losses = run(5, tmp_path / "resumed", str(tmp_path / "whole/checkpoint-2"))
    assert len(resumed_losses) == 2
    assert all(torch.equal(a, b) for a, b in zip(whole_losses[2:], resumed_losses, strict=True))
    assert_state_equal(resumed, whole)
