"""The ``nn.Linear`` layers of a Hugging Face architecture, from its ``config.json`` alone.

The model is built on the meta device (no memory, no weights) by the class its config names,
so an export from a state dict can tell ``nn.Linear`` weights (``(out, in)``) from layers that
store theirs otherwise (GPT-2's ``Conv1D``: ``(in, out)``).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fp8state.errors import ExportError

__all__ = ["linear_names"]


def linear_names(config_dir: str | os.PathLike[str]) -> set[str]:
    """Names of every ``nn.Linear`` of the architecture ``config_dir/config.json`` names.

    Raises:
        ExportError: transformers is not installed, or the config names no class it has.
    """
    try:
        import transformers
    except ImportError:
        raise ExportError(
            os.fspath(config_dir),
            "transformers not installed",
            "transformers, to read the architecture config.json names",
            "pip install transformers, or export from Python with fp8state.export_fp8(model).",
        ) from None
    config = transformers.AutoConfig.from_pretrained(os.fspath(config_dir))
    classes = [getattr(transformers, n, None) for n in (config.architectures or [])]
    if not classes or classes[0] is None:
        raise ExportError(
            os.fspath(config_dir),
            f"architectures {config.architectures!r}",
            "a model class transformers has",
            "Export from Python with fp8state.export_fp8(model), which needs no config.",
        )
    with torch.device("meta"):
        model = classes[0](config)
    return {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
