"""What an exported folder holds, for ``fp8state inspect``: its FP8 layers and their scales."""

from __future__ import annotations

from typing import Any

from fp8state.errors import ExportError
from fp8state.export._layers import join
from fp8state.export._shards import unreadable, weight_files

__all__ = ["describe_export"]


def describe_export(folder: str, quant: dict[str, Any]) -> dict[str, Any]:
    """``{"format", "layers": {name: {shape, weight_scale, input_scale}}, "ignore"}``.

    Raises:
        ExportError: no weight files, or a layer without its weight or one of its scales.
    """
    from safetensors import safe_open

    # One pass over each file: every tensor's shape from the header, each scale's value.
    shapes: dict[str, list[int]] = {}
    scales: dict[str, float] = {}
    for path in weight_files(folder):
        try:
            with safe_open(path, framework="pt") as file:
                for key in file.keys():
                    shapes[key] = list(file.get_slice(key).get_shape())
                    if key.split(".")[-1] in ("weight_scale", "input_scale"):
                        scales[key] = file.get_tensor(key).item()
        except Exception as err:  # safetensors reports damage as its own error types
            raise unreadable(path, err, "fp8state export") from None
    layers: dict[str, Any] = {}
    for key in sorted(k for k in shapes if k.split(".")[-1] == "weight_scale"):
        name = key[: -len("weight_scale")].rstrip(".")
        weight, weight_scale, input_scale = (
            join(name, leaf) for leaf in ("weight", "weight_scale", "input_scale")
        )
        if weight not in shapes or input_scale not in scales:
            raise ExportError(
                name,
                "a weight_scale without its weight or input_scale",
                "weight, weight_scale and input_scale",
                "The folder is damaged; export again.",
            )
        layers[name] = {
            "shape": shapes[weight],
            "weight_scale": scales[weight_scale],
            "input_scale": scales[input_scale],
        }
    ignore = list(quant.get("ignore", []))
    return {"format": quant.get("format"), "layers": layers, "ignore": ignore}
