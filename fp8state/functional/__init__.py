"""Functional building blocks for writing your own FP8 modules on :class:`FP8StateMixin`.

Also ``activation_checkpoint``: activation checkpointing that replays FP8 exactly.
"""

from __future__ import annotations

import torch

from fp8state.errors import ConfigError
from fp8state.functional import linear as _fp8_linear
from fp8state.functional.checkpointing import activation_checkpoint
from fp8state.mixin import FP8StateMixin

__all__ = ["fp8_linear", "activation_checkpoint"]


def fp8_linear(
    module: FP8StateMixin,
    inp: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    gemm: int = 0,
) -> torch.Tensor:
    """``F.linear(inp, weight, bias)`` as GEMM ``gemm`` of ``module``, in FP8 under autocast.

    Inside ``fp8_autocast(enabled=True)`` the input and weight are quantized with the scales of
    forward slots ``3 * gemm`` and ``3 * gemm + 1`` of ``module`` and the gradient with backward
    slot ``2 * gemm``; their amaxes are recorded for the next step. Elsewhere this is exactly
    ``F.linear``.

    Args:
        module: The module owning the FP8 metadata (it called ``init_fp8_meta``).
        inp: ``(..., in_features)``.
        weight: ``(out_features, in_features)``.
        bias: ``(out_features,)`` or None.
        gemm: Which of the module's GEMMs this is (0-based, below ``num_gemms``).

    Returns:
        ``(..., out_features)``, in ``inp``'s dtype.

    Raises:
        ConfigError: ``gemm`` is not one of the module's GEMMs.

    Example:
        >>> import torch, torch.nn.functional as F, fp8state
        >>> from fp8state.functional import fp8_linear
        >>> class Proj(fp8state.FP8StateMixin):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight = torch.nn.Parameter(torch.randn(16, 16))
        ...         self.init_fp8_meta(num_gemms=1)
        ...     def forward(self, x):
        ...         return fp8_linear(self, x, self.weight)
        >>> proj, x = Proj(), torch.randn(4, 16)
        >>> torch.equal(proj(x), F.linear(x, proj.weight))  # outside fp8_autocast
        True
        >>> with fp8state.fp8_autocast():
        ...     y = proj(x)
        >>> proj.fp8_last_gemm_backend  # on a CPU; "scaled_mm" on an FP8-capable GPU
        'emulated'
        >>> bool(proj.fp8_meta("fwd").amax_history[0, 0] == x.abs().max())  # input slot
        True
    """
    if not 0 <= gemm < module.fp8_num_gemms:
        raise ConfigError(
            f"fp8_linear(gemm={gemm})",
            f"GEMM index {gemm}",
            f"0 <= gemm < {module.fp8_num_gemms} (the module's num_gemms)",
            "Declare enough GEMMs in init_fp8_meta(num_gemms=...).",
        )
    return _fp8_linear.linear(module, inp, weight, bias, gemm)
