"""Pure FP8 cast functions: high precision -> FP8 with a scale, FP8 -> high precision, amax.

Shared by both GEMM backends, so the emulation on CPU runs exactly the scaling math the
``torch._scaled_mm`` path runs on GPUs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fp8state.errors import ConfigError

__all__ = ["finite_amax", "quantize", "dequantize", "CAST_OPS", "apply_op"]

#: What a slot cast can cast (:func:`apply_op` defines each); the Triton kernel numbers them in
#: this order.
CAST_OPS = ("identity", "gelu", "dgelu")


def finite_amax(x_hp: torch.Tensor) -> torch.Tensor:
    """``max(|x|)`` over the finite elements, as a 0-d float32 tensor (0 if there are none).

    Infinities and NaNs (an overflowing step) are left out, so they neither freeze the scale
    for a whole history window nor make the history invalid in a checkpoint.
    """
    if x_hp.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x_hp.device)
    magnitude = x_hp.detach().abs().to(torch.float32)
    return torch.where(torch.isfinite(magnitude), magnitude, 0.0).amax()


def quantize(x_hp: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x * scale)`` in ``fp8_dtype``.

    Values beyond the FP8 range are clamped to its maximum (a plain cast would give NaN for
    E4M3, which has no infinity). NaN stays NaN.

    Args:
        x_hp: High-precision tensor.
        scale: 0-d or 1-element float32 scale of the tensor's slot.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    """
    fp8_max = torch.finfo(fp8_dtype).max
    scaled = x_hp.to(torch.float32) * scale.reshape(())
    return scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype)


def dequantize(x_fp8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x_fp8 * scale_inv`` in ``dtype`` (computed in float32)."""
    return (x_fp8.to(torch.float32) * scale_inv.reshape(())).to(dtype)


def apply_op(x: torch.Tensor, op: str, aux: torch.Tensor | None = None) -> torch.Tensor:
    """The value a slot cast casts for ``op`` (reference definition, float32 math)."""
    if op == "identity":
        return x
    if op == "gelu":
        return F.gelu(x.float(), approximate="tanh")
    if op == "dgelu" and aux is not None:
        return torch.ops.aten.gelu_backward(x.float(), aux.float(), approximate="tanh")
    raise ConfigError(
        "cast_slot(op=...)",
        f"{op!r} (aux given: {aux is not None})",
        "'identity', 'gelu', or 'dgelu' with aux",
        "Pass one of the supported ops (this is a bug in the caller).",
    )
