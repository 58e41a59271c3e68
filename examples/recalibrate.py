"""Recalibrate FP8 scales after loading weights trained elsewhere.

Run: python examples/recalibrate.py

Delayed scaling quantizes each step with scales measured on earlier steps. Load other weights
into a model that trained in FP8 and its scales describe the old weights: here the new weights
are 8 times larger, so with the old scales they saturate at the FP8 maximum and the first FP8
forward is garbage. ``fp8state.recalibrate`` measures amaxes on a few batches (computing in
high precision, under ``torch.no_grad``) and sets every scale from them, changing nothing else.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

import fp8state

IN, HIDDEN = 128, 512


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; FP8 (E4M3) alone gives about 25-30 dB."""
    return float(20 * torch.log10(reference.norm() / (reference - approx).norm()))


def fp8_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), fp8state.fp8_autocast():
        return model(x)


def main() -> int:
    torch.manual_seed(0)
    model = nn.Sequential(fp8state.Linear(IN, HIDDEN), nn.GELU(approximate="tanh"),
                          fp8state.Linear(HIDDEN, IN))
    # A few FP8 training steps: the model's scales now fit its own weights and inputs.
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(3):
        with fp8state.fp8_autocast():
            loss = model(torch.randn(64, IN)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    # Weights trained elsewhere, in high precision (same key names as fp8state's modules).
    source = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(approximate="tanh"),
                           nn.Linear(HIDDEN, IN))
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(8)
    missing = model.load_state_dict(source.state_dict(), strict=False).missing_keys
    print(f"loaded the new weights; kept the old FP8 metadata: {missing}")

    x = torch.randn(64, IN)
    reference = source(x).detach()  # what the new weights compute in high precision
    before = sqnr_db(reference, fp8_forward(copy.deepcopy(model), x))

    report = fp8state.recalibrate(model, [torch.randn(64, IN) for _ in range(4)])
    after = sqnr_db(reference, fp8_forward(model, x))
    print(f"recalibrated {len(report.modules)} FP8 modules on {report.batches} batches")
    print(f"FP8 output vs high precision: {before:.1f} dB with the stale scales, "
          f"{after:.1f} dB after recalibrate")
    if not (after > 20 and after > before + 10):
        print("recalibration did not restore FP8 accuracy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
