"""FP8 modules with TransformerEngine's constructor arguments and state-dict names."""

from fp8state.modules.conv1d import Conv1D
from fp8state.modules.layernorm_linear import LayerNormLinear
from fp8state.modules.layernorm_mlp import LayerNormMLP
from fp8state.modules.linear import Linear
from fp8state.modules.normalization import LayerNorm, RMSNorm

__all__ = ["Linear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP", "Conv1D"]
