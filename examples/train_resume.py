"""Train in FP8, checkpoint model and optimizer, resume in a fresh model: bit-identical losses.

Run: python examples/train_resume.py

The checkpoint is an ordinary ``torch.save`` of ``model.state_dict()`` and
``optimizer.state_dict()``. The FP8 scaling metadata (amax histories, scales, recipe) travels
inside the model's state dict as plain CPU tensors, so ``torch.load(weights_only=True)`` reads
it and the resumed run continues exactly where the first one stopped.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fp8state

HIDDEN, STEPS, CHECKPOINT_AT = 32, 16, 8
RECIPE = fp8state.DelayedScaling(amax_history_len=16)  # scales from the last 16 steps' amaxes


def build_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small residual MLP of fp8state modules, and its optimizer."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        fp8state.LayerNormMLP(HIDDEN, 4 * HIDDEN),  # LayerNorm + fc1 + gelu + fc2: 2 FP8 GEMMs
        fp8state.Linear(HIDDEN, 1),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of a given step: seeded by the step, so both runs see the same data."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(32, HIDDEN, generator=gen)
    teacher = torch.linspace(-1, 1, HIDDEN).unsqueeze(1) / HIDDEN**0.5  # a fixed target map
    return x, torch.tanh(2 * x @ teacher)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """The usual loop; only the forward pass sits inside fp8_autocast."""
    losses = []
    for step in steps:
        x, y = batch(step)
        with fp8state.fp8_autocast(fp8_recipe=RECIPE):
            pred = model(x)  # GEMMs in FP8 (emulated on CPU, torch._scaled_mm on H100/H200)
        loss = F.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()  # backward FP8 scales update when backward finishes
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    # Run 1: uninterrupted, with a checkpoint taken half-way.
    model, opt = build_model(seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        losses = train(model, opt, range(CHECKPOINT_AT))
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": CHECKPOINT_AT},
            path,
        )
        losses += train(model, opt, range(CHECKPOINT_AT, STEPS))

        # Run 2: a fresh model, as a new process would build it (other seed: nothing shared),
        # loads the checkpoint and trains the second half again.
        fresh, fresh_opt = build_model(seed=1)
        ckpt = torch.load(path, weights_only=True)  # no pickled objects needed
        # Validates every FP8 extra state, key and shape first: all or nothing.
        fp8state.checkpoint.load_state_dict(fresh, ckpt["model"])
        fresh_opt.load_state_dict(ckpt["optimizer"])
        resumed = train(fresh, fresh_opt, range(int(ckpt["step"]), STEPS))

    print(f"loss: step 0 {losses[0]:.4f} -> step {STEPS - 1} {losses[-1]:.4f}")
    mlp, fresh_mlp = model[0], fresh[0]
    scales = [round(s, 2) for s in mlp.fp8_meta("fwd").scale.tolist()]
    print(f"FP8 forward scales of the MLP: {scales}")
    same_losses = resumed == losses[CHECKPOINT_AT:]
    same_meta = all(
        torch.equal(getattr(a.fp8_meta(d), f), getattr(b.fp8_meta(d), f))
        for a, b in ((mlp, fresh_mlp), (model[1], fresh[1]))
        for d in ("fwd", "bwd")
        for f in ("amax_history", "scale", "scale_inv")
    )
    same_weights = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    if not (same_losses and same_meta and same_weights):
        print(
            f"resume differs: losses {same_losses}, FP8 metadata {same_meta}, "
            f"weights {same_weights}",
            file=sys.stderr,
        )
        return 1
    print(
        f"resumed at step {CHECKPOINT_AT}: losses of steps {CHECKPOINT_AT}-{STEPS - 1}, "
        "weights and FP8 metadata identical bit for bit"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
