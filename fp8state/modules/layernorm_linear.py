"""``fp8state.LayerNormLinear``: a norm followed by an FP8 linear layer (TE's names)."""

from __future__ import annotations

import torch

from fp8state.functional import linear as _fp8_linear
from fp8state.mixin import FP8StateMixin
from fp8state.modules._params import (
    check_normalization,
    input_norm,
    new_norm_params,
    new_param,
    normalize,
    reset_linear_,
    reset_norm_,
)

__all__ = ["LayerNormLinear"]


class LayerNormLinear(FP8StateMixin):
    """``linear(norm(x))``; the norm in high precision, the GEMM in FP8 under ``fp8_autocast``.

    State-dict keys are TE's: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only),
    ``weight (out, in)``, ``bias`` (absent when ``bias=False``), ``_extra_state``.

    Args:
        in_features: Size of the last input dimension (the normalized one).
        out_features: Size of the last output dimension.
        eps: Norm epsilon.
        bias: Learn an additive bias for the linear part.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        params_dtype: dtype of the parameters.
        device: Device of parameters and FP8 metadata.
        return_layernorm_output: Also return the norm's output, as TE can.

    Example:
        >>> import torch, fp8state
        >>> layer = fp8state.LayerNormLinear(32, 16, normalization="RMSNorm")
        >>> list(layer.state_dict())  # an RMSNorm has no layer_norm_bias
        ['layer_norm_weight', 'weight', 'bias', '_extra_state']
        >>> with fp8state.fp8_autocast():
        ...     y = layer(torch.randn(4, 32))
        >>> y.shape, layer.fp8_num_gemms
        (torch.Size([4, 16]), 1)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        return_layernorm_output: bool = False,
    ) -> None:
        super().__init__()
        check_normalization("LayerNormLinear", normalization)
        self.in_features = in_features
        self.out_features = out_features
        self.eps = eps
        self.normalization = normalization
        self.return_layernorm_output = return_layernorm_output
        self.layer_norm_weight, self.layer_norm_bias = new_norm_params(
            in_features, normalization, dtype=params_dtype, device=device
        )
        self.weight = new_param(out_features, in_features, dtype=params_dtype, device=device)
        self.bias = new_param(out_features, dtype=params_dtype, device=device) if bias else None
        self.reset_parameters()
        self.init_fp8_meta(num_gemms=1, device=device)

    def reset_parameters(self) -> None:
        """Norm weight 1 and bias 0; the linear part as ``nn.Linear``."""
        reset_norm_(self.layer_norm_weight, self.layer_norm_bias)
        reset_linear_(self.weight, self.bias)

    def forward(
        self, inp: torch.Tensor, is_first_microbatch: bool | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Apply norm and linear layer to ``inp (..., in_features)``.

        ``is_first_microbatch`` as in :meth:`fp8state.Linear.forward`.
        """
        norm = input_norm(self)
        if norm is not None:  # the FP8 input cast computes the norm
            return _fp8_linear.linear(
                self, inp, self.weight, self.bias, 0, is_first_microbatch, norm=norm
            )
        normed = normalize(
            inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps
        )
        out = _fp8_linear.linear(self, normed, self.weight, self.bias, 0, is_first_microbatch)
        return (out, normed) if self.return_layernorm_output else out

    def fp8_gemm_weights(self) -> tuple[torch.Tensor, ...]:
        """As :meth:`fp8state.Linear.fp8_gemm_weights`: the one GEMM's ``weight``."""
        return (self.weight,)

    def extra_repr(self) -> str:
        """Shapes and the norm, as ``nn.Linear`` and the norms print them."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, normalization={self.normalization}, eps={self.eps}"
        )
