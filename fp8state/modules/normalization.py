"""``fp8state.LayerNorm`` and ``fp8state.RMSNorm``: high-precision norms with TE's names.

They run no GEMM, so they hold no FP8 metadata and have no ``_extra_state``.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8state.modules._params import new_param, normalize

__all__ = ["LayerNorm", "RMSNorm"]


class LayerNorm(nn.Module):
    """``nn.LayerNorm(hidden_size, eps)``; state-dict keys ``weight`` and ``bias``.

    Args:
        hidden_size: Size of the normalized (last) dimension.
        eps: Added to the variance.
        params_dtype: dtype of the parameters.
        device: Device of the parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param(hidden_size, dtype=params_dtype, device=device)
        self.bias = new_param(hidden_size, dtype=params_dtype, device=device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight 1, bias 0."""
        if self.weight.device.type != "meta":
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension of ``inp``."""
        return normalize(inp, "LayerNorm", self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """``nn.RMSNorm(hidden_size, eps)``; state-dict key ``weight``.

    Args:
        hidden_size: Size of the normalized (last) dimension.
        eps: Added to the mean square.
        params_dtype: dtype of the parameters.
        device: Device of the parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param(hidden_size, dtype=params_dtype, device=device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight 1."""
        if self.weight.device.type != "meta":
            nn.init.ones_(self.weight)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension of ``inp``."""
        return normalize(inp, "RMSNorm", self.weight, None, self.eps)
