"""What an exported folder holds, for ``fp8state inspect``: its FP8 layers and their scales."""

from __future__ import annotations

import os
from typing import Any

from fp8state.errors import ExportError
from fp8state.export._folder import WEIGHTS_FILE

__all__ = ["describe_export"]


def describe_export(folder: str, quant: dict[str, Any]) -> dict[str, Any]:
    """``{"format", "layers": {name: {shape, weight_scale, input_scale}}, "ignore"}``.

    Raises:
        ExportError: the folder has no ``model.safetensors`` or a layer lacks a scale.
    """
    from safetensors import safe_open

    path = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise ExportError(folder, f"no {WEIGHTS_FILE}", "the export's weights", "Export again.")
    layers: dict[str, Any] = {}
    with safe_open(path, framework="pt") as file:
        keys = set(file.keys())
        for key in sorted(k for k in keys if k.endswith(".weight_scale")):
            name = key[: -len(".weight_scale")]
            if f"{name}.input_scale" not in keys or f"{name}.weight" not in keys:
                raise ExportError(
                    name,
                    "a weight_scale alone",
                    "weight, weight_scale and input_scale",
                    "The folder is damaged; export again.",
                )
            layers[name] = {
                "shape": list(file.get_slice(f"{name}.weight").get_shape()),
                "weight_scale": file.get_tensor(key).item(),
                "input_scale": file.get_tensor(f"{name}.input_scale").item(),
            }
    ignore = list(quant.get("ignore", []))
    return {"format": quant.get("format"), "layers": layers, "ignore": ignore}
