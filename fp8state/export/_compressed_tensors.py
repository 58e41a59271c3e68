"""compressed-tensors' per-tensor static FP8 scheme: the tensors and the ``quantization_config``.

The fields follow compressed-tensors' ``QuantizationConfig`` and its ``FP8`` preset scheme
(``compressed_tensors/quantization/quant_scheme.py``) as ``ModelCompressor.update_config``
writes them into ``config.json`` (docs/export.md lists each field and why).
"""

from __future__ import annotations

from typing import Any

import torch

from fp8state.export._layers import Layer, Plan, join
from fp8state.export._scales import InputScaleRule, input_scale_inv, quantize_weight

__all__ = ["FORMAT_NAME", "QUANT_METHOD", "quantized_tensors", "quantization_config"]

QUANT_METHOD = "compressed-tensors"
FORMAT_NAME = "float-quantized"

# One set of arguments for weights and inputs: 8-bit float, one scale per tensor, symmetric
# (no zero point), static (the scale is in the file, not computed at run time).
_ARGS: dict[str, Any] = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "group_size": None,
    "strategy": "tensor",
    "dynamic": False,
}


def quantized_tensors(plan: Plan, rule: InputScaleRule) -> dict[str, torch.Tensor]:
    """The plan's tensors with each layer's weight in FP8 and its two scales beside it.

    Every scale is computed (and every refusal raised) before the result is assembled.
    """
    converted: list[tuple[Layer, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for layer in plan.layers:
        weight, weight_scale = quantize_weight(layer.weight, layer.recipe, layer.name)
        input_scale = input_scale_inv(
            layer.history, layer.stored_scale, layer.recipe, rule, layer.name
        )
        converted.append((layer, weight, weight_scale, input_scale))
    out = dict(plan.tensors)
    for layer, weight, weight_scale, input_scale in converted:
        del out[layer.weight_key]
        if layer.bias_key is not None:
            out[join(layer.name, "bias")] = out.pop(layer.bias_key)
        out[join(layer.name, "weight")] = weight.contiguous()
        out[join(layer.name, "weight_scale")] = weight_scale
        out[join(layer.name, "input_scale")] = input_scale
    return out


def quantization_config(ignore: list[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``: every ``nn.Linear`` but ``ignore`` in FP8.

    Args:
        ignore: Names of the ``Linear`` layers left in the training dtype.
    """
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT_NAME,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": dict(_ARGS),
                "input_activations": dict(_ARGS),
                "output_activations": None,
                "format": FORMAT_NAME,
            }
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }
