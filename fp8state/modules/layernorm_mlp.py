"""``fp8state.LayerNormMLP``: norm, FP8 fc1, activation, FP8 fc2 (TE's names and slots)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fp8state.errors import ConfigError
from fp8state.functional import linear as _fp8_linear
from fp8state.functional import mlp as _fp8_mlp
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

__all__ = ["LayerNormMLP", "ACTIVATIONS"]

ACTIVATIONS = ("gelu", "relu", "swiglu")


def _activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(x, approximate="tanh")  # TE's "gelu" is the tanh approximation
    if activation == "relu":
        return F.relu(x)
    gate, up = x.chunk(2, dim=-1)  # TE's swiglu: silu(first half) * second half
    return F.silu(gate) * up


class LayerNormMLP(FP8StateMixin):
    """``fc2(act(fc1(norm(x))))`` with both GEMMs in FP8 under ``fp8_autocast``.

    GEMM 0 is fc1 (forward slots 0-2, backward 0-1), GEMM 1 is fc2 (forward 3-5, backward 2-3),
    as in TE. State-dict keys: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only),
    ``fc1_weight`` (``(ffn, hidden)``, ``(2*ffn, hidden)`` for swiglu), ``fc1_bias``,
    ``fc2_weight (hidden, ffn)``, ``fc2_bias`` (biases absent when ``bias=False``),
    ``_extra_state``.

    Args:
        hidden_size: Input and output size.
        ffn_hidden_size: Inner size.
        eps: Norm epsilon.
        bias: Learn biases for fc1 and fc2.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        activation: ``"gelu"`` (tanh approximation, as TE), ``"relu"`` or ``"swiglu"``.
        params_dtype: dtype of the parameters.
        device: Device of parameters and FP8 metadata.
        return_layernorm_output: Also return the norm's output, as TE can.

    Example:
        >>> import torch, fp8state
        >>> mlp = fp8state.LayerNormMLP(32, 64, activation="swiglu")
        >>> {k: tuple(v.shape) for k, v in mlp.state_dict().items() if k != "_extra_state"}
        ... # doctest: +NORMALIZE_WHITESPACE
        {'layer_norm_weight': (32,), 'layer_norm_bias': (32,), 'fc1_weight': (128, 32),
         'fc1_bias': (128,), 'fc2_weight': (32, 64), 'fc2_bias': (32,)}
        >>> len(mlp.fp8_meta("fwd").scale), len(mlp.fp8_meta("bwd").scale)  # 2 GEMMs
        (6, 4)
    """

    #: With ``activation="gelu"`` under ``fp8_autocast``, compute GELU and its derivative
    #: inside the FP8 casts (fp8state/functional/mlp.py): less memory traffic and no
    #: high-precision activation or activation gradient in memory, but one backward per
    #: forward (as TE: a second backward through the same graph is an error). False runs fc1,
    #: GELU and fc2 as separate steps: the same slots, and for float32 inputs the same numbers
    #: on the emulated path (on GPUs GELU's float32 rounding may differ).
    fp8_fuse_activation: bool = True

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        return_layernorm_output: bool = False,
    ) -> None:
        super().__init__()
        check_normalization("LayerNormMLP", normalization)
        if activation not in ACTIVATIONS:
            raise ConfigError(
                "LayerNormMLP(activation=...)",
                repr(activation),
                f"one of {ACTIVATIONS}",
                "Pass one of TE's activation names.",
            )
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.eps = eps
        self.normalization = normalization
        self.activation = activation
        self.return_layernorm_output = return_layernorm_output
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        param = functools.partial(new_param, dtype=params_dtype, device=device)
        self.layer_norm_weight, self.layer_norm_bias = new_norm_params(
            hidden_size, normalization, dtype=params_dtype, device=device
        )
        self.fc1_weight = param(fc1_out, hidden_size)
        self.fc1_bias = param(fc1_out) if bias else None
        self.fc2_weight = param(hidden_size, ffn_hidden_size)
        self.fc2_bias = param(hidden_size) if bias else None
        self.reset_parameters()
        self.init_fp8_meta(num_gemms=2, device=device)

    def reset_parameters(self) -> None:
        """Norm weight 1 and bias 0; fc1 and fc2 as ``nn.Linear``."""
        reset_norm_(self.layer_norm_weight, self.layer_norm_bias)
        reset_linear_(self.fc1_weight, self.fc1_bias)
        reset_linear_(self.fc2_weight, self.fc2_bias)

    def forward(
        self, inp: torch.Tensor, is_first_microbatch: bool | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Apply the block to ``inp (..., hidden_size)``.

        ``is_first_microbatch`` as in :meth:`fp8state.Linear.forward`.
        """
        norm = input_norm(self)  # where not None, fc1's input cast computes the norm
        normed = inp
        if norm is None:
            normed = normalize(
                inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps
            )
        if self.activation == "gelu" and self.fp8_fuse_activation:
            out = _fp8_mlp.gelu_mlp(
                self,
                normed,
                self.fc1_weight,
                self.fc1_bias,
                self.fc2_weight,
                self.fc2_bias,
                is_first_microbatch,
                norm,
            )
            if out is not None:
                return (out, normed) if self.return_layernorm_output else out
        hidden = _fp8_linear.linear(
            self, normed, self.fc1_weight, self.fc1_bias, 0, is_first_microbatch, norm=norm
        )
        out = _fp8_linear.linear(
            self,
            _activate(hidden, self.activation),
            self.fc2_weight,
            self.fc2_bias,
            1,
            is_first_microbatch,
        )
        return (out, normed) if self.return_layernorm_output else out

    def fp8_gemm_weights(self) -> tuple[torch.Tensor, ...]:
        """As :meth:`fp8state.Linear.fp8_gemm_weights`: fc1's weight, then fc2's."""
        return (self.fc1_weight, self.fc2_weight)

    def extra_repr(self) -> str:
        """Sizes, norm and activation."""
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"bias={self.fc1_bias is not None}, normalization={self.normalization}, "
            f"activation={self.activation}, eps={self.eps}"
        )
