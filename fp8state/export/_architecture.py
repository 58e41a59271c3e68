"""The ``nn.Linear`` layers of a Hugging Face architecture, from its ``config.json`` alone.

The model is built on the meta device (no memory, no weights) by the class its config names,
so an export from a state dict can tell ``nn.Linear`` weights (``(out, in)``) from layers that
store theirs otherwise (GPT-2's ``Conv1D``: ``(in, out)``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from fp8state._shown import shown
from fp8state.errors import ExportError

__all__ = ["Architecture", "architecture"]


@dataclass(frozen=True)
class Architecture:
    """What a Hugging Face architecture holds.

    Attributes:
        linears: Names of its ``nn.Linear`` modules.
        keys: Its state dict's keys.
    """

    linears: frozenset[str]
    keys: frozenset[str]


def architecture(config_dir: str | os.PathLike[str]) -> Architecture:
    """The architecture ``config_dir/config.json`` names, built on the meta device.

    Raises:
        ExportError: transformers is not installed, or the config cannot be read or names no
            class transformers has.
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
    try:
        config = transformers.AutoConfig.from_pretrained(os.fspath(config_dir))
    except (OSError, ValueError, KeyError) as err:
        raise ExportError(
            os.path.join(os.fspath(config_dir), "config.json"),
            f"a config transformers cannot read ({type(err).__name__}: {shown(str(err))})",
            "a Hugging Face config.json",
            "Pass --config with the folder save_pretrained wrote for this model.",
        ) from None
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
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    return Architecture(frozenset(linears), frozenset(model.state_dict()))
