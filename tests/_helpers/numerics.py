"""Numerical helpers: SQNR, and the bytes of a tensor for bit-exact comparisons."""

from __future__ import annotations

import torch


def sqnr(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``y`` against reference ``x``, in dB.

    ``20 * log10(||x|| / ||x - y||)`` (torchao's ``compute_error``); ``inf`` when equal.
    """
    x, y = x.detach().double(), y.detach().double()
    noise = torch.linalg.vector_norm(x - y)
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(torch.linalg.vector_norm(x) / noise))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``, flat, on the CPU (so NaN == NaN and -0.0 != 0.0)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def past_the_maximum(fp8_dtype: torch.dtype) -> list[float]:
    """Values at and past ``fp8_dtype``'s maximum: each must saturate to it when cast.

    The maximum itself, values on both sides of the half-step past it (where rounding alone
    would leave the maximum: 1.0357x for E4M3, 1.0714x for E5M2), far past it, near float32's
    maximum, and infinity.
    """
    top = torch.finfo(fp8_dtype).max
    return [top, top * 1.03, top * 1.0625, top * 1.07, top * 1.2, 3e38, float("inf")]
