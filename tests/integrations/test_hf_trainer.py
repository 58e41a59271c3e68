"""Hugging Face ``Trainer`` on FP8 models, with the real package: checkpoints written with
``save_steps`` and a run resumed from one with ``resume_from_checkpoint`` equal the run that
was never interrupted, bit for bit (every loss, every weight, every FP8 buffer). The forward
runs under ``fp8_autocast`` through ``fp8state.autocast_forward``, as a user would set it up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _helpers.hf import cpu_training_args, tiny_fp8_model
from _helpers.state import assert_state_equal
from torch._dynamo.utils import counters

import fp8state

transformers = pytest.importorskip("transformers")

STEPS, SAVE_AT = 4, 2


def _dataset(rows: int = 16) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (rows, 16), generator=gen)
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(arch: str, out: Path, seed: int) -> tuple[transformers.Trainer, list[torch.Tensor]]:
    model = fp8state.autocast_forward(tiny_fp8_model(arch, seed))
    losses: list[torch.Tensor] = []
    model.register_forward_hook(lambda _m, _a, out: losses.append(out.loss.detach().clone()))
    args = cpu_training_args(
        str(out),
        max_steps=STEPS,
        save_steps=SAVE_AT,
        per_device_train_batch_size=2,
        logging_steps=1,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset())
    return trainer, losses


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_trainer_resumed_from_a_checkpoint_equals_the_uninterrupted_run(
    arch: str, tmp_path: Path
) -> None:
    whole, whole_losses = _trainer(arch, tmp_path / "whole", seed=0)
    whole.train()
    assert len(whole_losses) == STEPS
    checkpoint = tmp_path / "whole" / f"checkpoint-{SAVE_AT}"
    assert list(checkpoint.glob("*.safetensors")), "Trainer saved with safetensors"
    fp8_modules = [m for m in whole.model.modules() if isinstance(m, fp8state.FP8StateMixin)]
    assert fp8_modules and all(m.fp8_last_gemm_backend == "emulated" for m in fp8_modules)

    # Other initial weights: whatever the resumed run matches must come from the checkpoint.
    resumed, resumed_losses = _trainer(arch, tmp_path / "resumed", seed=5)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert len(resumed_losses) == STEPS - SAVE_AT
    for step, (a, b) in enumerate(
        zip(whole_losses[SAVE_AT:], resumed_losses, strict=True), SAVE_AT + 1
    ):
        assert torch.equal(a, b), f"loss of step {step}: {a.item()} != {b.item()}"
    assert_state_equal(resumed.model, whole.model)
    for key, value in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key


def test_trainer_keeps_the_dataset_columns_the_model_takes(tmp_path: Path) -> None:
    # Trainer drops dataset columns its model's forward does not name; the wrapper keeps the
    # signature, so input_ids and labels reach the model (else Trainer would find no input).
    trainer, losses = _trainer("llama", tmp_path, seed=0)
    trainer.args.max_steps = 1
    trainer.args.save_steps = 10
    trainer.train()
    assert len(losses) == 1 and torch.isfinite(losses[0])


def test_trainer_with_torch_compile_trains_as_eager(tmp_path: Path) -> None:
    # TrainingArguments(torch_compile=True): Trainer compiles the model (Accelerate's dynamo
    # plugin), fp8_autocast entered inside the compiled forward by autocast_forward. With
    # aot_eager, every step equals the uncompiled Trainer's, bit for bit, in one graph.

    class Recording(transformers.Trainer):  # losses outside the compiled frame
        losses: list[torch.Tensor]

        def compute_loss(self, model, inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.losses.append(loss.detach().clone())
            return loss

    runs = []
    for compiled in (False, True):
        settings = {"torch_compile": True, "torch_compile_backend": "aot_eager"} if compiled else {}
        args = cpu_training_args(
            str(tmp_path / str(compiled)),
            max_steps=STEPS,
            save_steps=10 * STEPS,
            per_device_train_batch_size=2,
            **settings,
        )
        model = fp8state.autocast_forward(tiny_fp8_model("llama", seed=0))
        trainer = Recording(model=model, args=args, train_dataset=_dataset())
        trainer.losses = []
        torch._dynamo.reset()
        counters.clear()
        trainer.train()
        runs.append(trainer)
    eager, compiled_run = runs
    assert isinstance(compiled_run.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert len(compiled_run.losses) == STEPS
    for a, b in zip(eager.losses, compiled_run.losses, strict=True):
        assert torch.equal(a, b)
    assert_state_equal(compiled_run.model, eager.model)
    for key, value in eager.model.state_dict().items():
        assert torch.equal(compiled_run.model.state_dict()[key], value), key
