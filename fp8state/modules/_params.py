"""Parameter helpers shared by the modules: creation, initialization as in torch.nn, norms."""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from fp8state.errors import ConfigError
from fp8state.functional.norm import InputNorm

__all__ = [
    "NORMALIZATIONS",
    "check_normalization",
    "new_param",
    "new_norm_params",
    "reset_linear_",
    "reset_norm_",
    "normalize",
    "input_norm",
]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(module_name: str, normalization: str) -> None:
    """Raise ConfigError unless ``normalization`` is ``"LayerNorm"`` or ``"RMSNorm"``."""
    if normalization not in NORMALIZATIONS:
        raise ConfigError(
            f"{module_name}(normalization=...)",
            repr(normalization),
            f"one of {NORMALIZATIONS}",
            "Pass normalization='LayerNorm' or 'RMSNorm' (TE's spelling).",
        )


def new_param(
    *shape: int, dtype: torch.dtype | None, device: torch.device | str | None
) -> nn.Parameter:
    """An uninitialized parameter (filled by the module's ``reset_parameters``)."""
    return nn.Parameter(
        torch.empty(*shape, dtype=dtype or torch.get_default_dtype(), device=device)
    )


def new_norm_params(
    size: int,
    normalization: str,
    *,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> tuple[nn.Parameter, nn.Parameter | None]:
    """A norm's uninitialized ``(weight, bias)``; the bias is None for ``"RMSNorm"``."""
    weight = new_param(size, dtype=dtype, device=device)
    bias = new_param(size, dtype=dtype, device=device) if normalization == "LayerNorm" else None
    return weight, bias


@torch.no_grad()
def reset_norm_(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Weight 1 and bias 0, as ``nn.LayerNorm`` and ``nn.RMSNorm`` start (nothing on ``meta``)."""
    if weight.device.type == "meta":
        return
    nn.init.ones_(weight)
    if bias is not None:
        nn.init.zeros_(bias)


@torch.no_grad()
def reset_linear_(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Initialize like ``nn.Linear.reset_parameters``, so our modules are drop-in replacements."""
    if weight.device.type == "meta":
        return
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0.0
        nn.init.uniform_(bias, -bound, bound)


def normalize(
    x: torch.Tensor,
    normalization: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """LayerNorm or RMSNorm over the last dimension, exactly as ``torch.nn`` computes them."""
    return _as_input_norm(normalization, weight, bias, eps)(x)


def _as_input_norm(normalization: str, weight: torch.Tensor, bias: object, eps: float) -> InputNorm:
    """The norm ``normalization`` names with these parameters (RMSNorm takes no bias)."""
    rms = normalization == "RMSNorm"
    kept = bias if isinstance(bias, torch.Tensor) and not rms else None
    return InputNorm(weight, kept, eps, rms)


def input_norm(module: nn.Module) -> InputNorm | None:
    """The norm a ``LayerNorm*`` module's first GEMM may compute in its input cast, or None.

    None where the module also returns the norm's output (``return_layernorm_output``): that
    output must then be written anyway.
    """
    if module.return_layernorm_output:
        return None
    weight = module.layer_norm_weight
    assert isinstance(weight, torch.Tensor)  # a norm's weight
    normalization = cast(str, module.normalization)
    return _as_input_norm(normalization, weight, module.layer_norm_bias, cast(float, module.eps))
