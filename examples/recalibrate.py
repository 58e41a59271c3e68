"""Recalibrate FP8 scales after loading weights trained without FP8.

Run: python examples/recalibrate.py

Delayed scaling quantizes each step with scales measured on earlier steps, so weights trained
in high precision come without any. ``fp8state.checkpoint.load_plain_state_dict`` loads them
and gives every FP8 module a fresh module's metadata: scales of 1. These weights are small
(std 0.003), so at scale 1 they fall among E4M3's subnormals, which keep only a few bits, and
the first FP8 forward is noisy. ``fp8state.recalibrate`` measures amaxes on a few batches
(computing in high precision, under ``torch.no_grad``) and sets every scale from them,
changing nothing else.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

import fp8state

IN, HIDDEN = 128, 512


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; FP8 (E4M3) alone gives about 25-35 dB."""
    return float(20 * torch.log10(reference.norm() / (reference - approx).norm()))


def fp8_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), fp8state.fp8_autocast():
        return model(x)


def main() -> int:
    torch.manual_seed(0)
    model = nn.Sequential(
        fp8state.Linear(IN, HIDDEN), nn.GELU(approximate="tanh"), fp8state.Linear(HIDDEN, IN)
    )

    # Weights trained elsewhere, in high precision (same key names as fp8state's modules).
    source = nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.GELU(approximate="tanh"), nn.Linear(HIDDEN, IN)
    )
    with torch.no_grad():
        for p in source.parameters():
            p.normal_(0.0, 0.003)
    # Not load_state_dict(strict=False), which would skip a misspelled weight too: this checks
    # every weight and starts each FP8 module's metadata fresh (docs/faq.md).
    fp8state.checkpoint.load_plain_state_dict(model, source.state_dict())
    scales = [float(m.fp8_meta("fwd").scale[1]) for m in (model[0], model[2])]
    print(f"loaded the new weights with load_plain_state_dict; weight scales {scales}")

    x = torch.randn(64, IN)
    reference = source(x).detach()  # what the new weights compute in high precision
    before = sqnr_db(reference, fp8_forward(copy.deepcopy(model), x))

    report = fp8state.recalibrate(model, [torch.randn(64, IN) for _ in range(4)])
    after = sqnr_db(reference, fp8_forward(model, x))
    print(f"recalibrated {len(report.modules)} FP8 modules on {report.batches} batches")
    print(
        f"FP8 output vs high precision: {before:.1f} dB with the fresh scales, "
        f"{after:.1f} dB after recalibrate"
    )
    if not (after > 20 and after > before + 10):
        print("recalibration did not restore FP8 accuracy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
