"""A norm in front of an FP8 GEMM (LayerNorm or RMSNorm), which its input cast may compute."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fp8state._runtime import norm_cast

__all__ = ["InputNorm", "applied", "from_args", "fused_or_applied", "norm_args"]


class InputNorm(NamedTuple):
    """``F.layer_norm`` (or, with ``rms``, ``F.rms_norm``) over the last dimension."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float
    rms: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of ``x`` as ``torch.nn.LayerNorm`` (``torch.nn.RMSNorm``) computes it."""
        if self.rms:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
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
) -> tuple[torch.Tensor | None, torch.Tensor | None, float | None, bool]:
    """What an FP8 autograd function takes for the norm: weight, bias, eps, rms (or Nones)."""
    if norm is None:
        return None, None, None, False
    return norm.weight, norm.bias, norm.eps, norm.rms


def from_args(
    weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float | None, rms: bool
) -> InputNorm | None:
    """The norm an FP8 autograd function was given (:func:`norm_args`), or None."""
    return None if weight is None or eps is None else InputNorm(weight, bias, eps, rms)
