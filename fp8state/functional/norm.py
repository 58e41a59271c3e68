"""A LayerNorm in front of an FP8 GEMM, which the GEMM's input cast may compute itself."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fp8state._runtime import norm_cast

__all__ = ["InputNorm", "applied", "from_args", "fused_or_applied", "norm_args"]


class InputNorm(NamedTuple):
    """``F.layer_norm`` over the last dimension with these parameters."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of ``x`` as ``torch.nn.LayerNorm`` computes it."""
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def fused_or_applied(
    inp: torch.Tensor, norm: InputNorm | None
) -> tuple[torch.Tensor, InputNorm | None]:
    """``(inp, norm)`` where the FP8 cast can compute the norm, else ``(norm(inp), None)``."""
    if norm is None or norm_cast.fusable(inp, norm.weight, norm.bias):
        return inp, norm
    return norm(inp), None


def applied(inp: torch.Tensor, norm: InputNorm | None) -> torch.Tensor:
    """The norm's output (``inp`` itself where there is no norm)."""
    return inp if norm is None else norm(inp)


def norm_args(
    norm: InputNorm | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, float | None]:
    """What an FP8 autograd function takes for the norm: weight, bias, eps (Nones if none)."""
    return (None, None, None) if norm is None else (norm.weight, norm.bias, norm.eps)


def from_args(
    weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float | None
) -> InputNorm | None:
    """The norm an FP8 autograd function was given (:func:`norm_args`), or None."""
    return None if weight is None or eps is None else InputNorm(weight, bias, eps)
