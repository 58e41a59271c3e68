"""``fp8state.Linear``: ``nn.Linear`` with FP8 GEMMs under ``fp8_autocast`` (TE's names)."""

from __future__ import annotations

import torch

from fp8state.functional import linear as _fp8_linear
from fp8state.mixin import FP8StateMixin
from fp8state.modules._params import new_param, reset_linear_

__all__ = ["Linear"]


class Linear(FP8StateMixin):
    """``y = x @ weight.T + bias``; FP8 inside ``fp8_autocast``, exactly ``F.linear`` outside.

    State-dict keys are TE's: ``weight (out, in)``, ``bias (out,)`` (absent when
    ``bias=False``) and ``_extra_state`` (FP8 metadata, 3 forward / 2 backward slots).

    Args:
        in_features: Size of the last input dimension.
        out_features: Size of the last output dimension.
        bias: Learn an additive bias.
        params_dtype: dtype of the parameters (default: ``torch.get_default_dtype()``).
        device: Device of parameters and FP8 metadata (``"meta"`` allowed).

    Example:
        >>> import torch, torch.nn.functional as F, fp8state
        >>> layer, x = fp8state.Linear(32, 16), torch.randn(8, 32)
        >>> torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # no autocast
        True
        >>> with fp8state.fp8_autocast():  # FP8; the step's scales update at exit
        ...     y = layer(x)
        >>> scale = layer.fp8_meta("fwd").scale  # slots: input, weight, output
        >>> torch.equal(scale[0], torch.tensor(448.0) / x.abs().max())
        True
        >>> list(layer.state_dict())
        ['weight', 'bias', '_extra_state']
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = new_param(out_features, in_features, dtype=params_dtype, device=device)
        self.bias = new_param(out_features, dtype=params_dtype, device=device) if bias else None
        self.reset_parameters()
        self.init_fp8_meta(num_gemms=1, device=device)

    def reset_parameters(self) -> None:
        """Initialize as ``nn.Linear`` does."""
        reset_linear_(self.weight, self.bias)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """Apply the layer to ``inp (..., in_features)``.

        ``is_first_microbatch`` (TE's argument): None casts the weight to FP8 every call; True
        casts and keeps it; False reuses the kept FP8 weight (later micro-batches of a step).
        """
        return _fp8_linear.linear(self, inp, self.weight, self.bias, 0, is_first_microbatch)

    def fp8_gemm_weights(self) -> tuple[torch.Tensor, ...]:
        """The weight each GEMM multiplies with, by GEMM index, as the forward passes it.

        What :func:`fp8state.cast_weights_ahead` casts; a module of your own that defines this
        method can be cast ahead too.
        """
        return (self.weight,)

    def extra_repr(self) -> str:
        """Shapes, as ``nn.Linear`` prints them."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
