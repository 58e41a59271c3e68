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

    found: dict[str, tuple[str, str]] = {}  # tensor name -> (file, key)
    for path in weight_files(folder):
        try:
            with safe_open(path, framework="pt") as file:
                found.update((key, (path, key)) for key in file.keys())
        except Exception as err:  # safetensors reports damage as its own error types
            raise unreadable(path, err, "fp8state export") from None
    layers: dict[str, Any] = {}
    for key in sorted(k for k in found if k.split(".")[-1] == "weight_scale"):
        name = key[: -len("weight_scale")].rstrip(".")
        parts = [join(name, leaf) for leaf in ("weight", "weight_scale", "input_scale")]
        if not all(part in found for part in parts):
            raise ExportError(
                name,
                "a weight_scale without its weight or input_scale",
                "weight, weight_scale and input_scale",
                "The folder is damaged; export again.",
            )
        with safe_open(found[parts[0]][0], framework="pt") as file:
            shape = list(file.get_slice(parts[0]).get_shape())
        scales = []
        for part in parts[1:]:
            with safe_open(found[part][0], framework="pt") as file:
                scales.append(file.get_tensor(part).item())
        layers[name] = {"shape": shape, "weight_scale": scales[0], "input_scale": scales[1]}
    ignore = list(quant.get("ignore", []))
    return {"format": quant.get("format"), "layers": layers, "ignore": ignore}
