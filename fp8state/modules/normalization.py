"""``fp8state.LayerNorm`` and ``fp8state.RMSNorm``: high-precision norms with TE's names.

They run no GEMM, so they hold no FP8 metadata and have no ``_extra_state``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from fp8state.modules._params import new_norm_params, normalize, reset_norm_

__all__ = ["LayerNorm", "RMSNorm"]


class _Norm(nn.Module):
    """The body both norms share; a subclass only names its ``normalization``."""

    normalization: ClassVar[str]

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        weight, bias = new_norm_params(
            hidden_size, self.normalization, dtype=params_dtype, device=device
        )
        self.weight = weight
        if bias is not None:  # RMSNorm has no bias attribute at all, as nn.RMSNorm
            self.bias = bias
        self.reset_parameters()

    def _bias(self) -> torch.Tensor | None:
        return getattr(self, "bias", None)

    def reset_parameters(self) -> None:
        """Weight 1 (and bias 0), as ``torch.nn`` initializes the norm."""
        reset_norm_(self.weight, self._bias())

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension of ``inp``."""
        return normalize(inp, self.normalization, self.weight, self._bias(), self.eps)

    def extra_repr(self) -> str:
        """Size and epsilon, as ``torch.nn``'s norms print them."""
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(_Norm):
    """``nn.LayerNorm(hidden_size, eps)``; state-dict keys ``weight`` and ``bias``.

    Args:
        hidden_size: Size of the normalized (last) dimension.
        eps: Added to the variance.
        params_dtype: dtype of the parameters.
        device: Device of the parameters.

    Example:
        >>> import torch, fp8state
        >>> norm, x = fp8state.LayerNorm(32), torch.randn(4, 32)
        >>> torch.equal(norm(x), torch.nn.LayerNorm(32)(x))
        True
        >>> list(norm.state_dict())  # no FP8 metadata: a norm runs no GEMM
        ['weight', 'bias']
    """

    normalization = "LayerNorm"


class RMSNorm(_Norm):
    """``nn.RMSNorm(hidden_size, eps)``; state-dict key ``weight``.

    Args:
        hidden_size: Size of the normalized (last) dimension.
        eps: Added to the mean square.
        params_dtype: dtype of the parameters.
        device: Device of the parameters.

    Example:
        >>> import torch, fp8state
        >>> norm, x = fp8state.RMSNorm(32), torch.randn(4, 32)
        >>> torch.equal(norm(x), torch.nn.RMSNorm(32, eps=1e-5)(x))
        True
        >>> list(norm.state_dict())
        ['weight']
    """

    normalization = "RMSNorm"
