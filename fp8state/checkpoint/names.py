"""The plain name of each key of a model's state dict, as ``to_plain_state_dict`` spells it."""

from __future__ import annotations

from torch import nn

from fp8state.checkpoint._entries import model_entries
from fp8state.checkpoint._plain_names import plain_keys

__all__ = ["plain_names"]


def plain_names(model: nn.Module) -> dict[str, str]:
    """``{model.state_dict() key: plain key}`` for every key of ``model``.

    Plain keys drop wrapper segments (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``,
    activation checkpointing's ``_checkpoint_wrapped_module.``) and give a ``LayerNormLinear``
    that ``convert_model`` fused its original norm's names back.

    Raises:
        CheckpointError: a fused module no longer fits its record.

    Example:
        >>> import torch, fp8state
        >>> from fp8state.checkpoint import plain_names
        >>> model = torch.compile(torch.nn.Sequential(fp8state.Linear(16, 16)))
        >>> plain_names(model)["_orig_mod.0.weight"]
        '0.weight'
    """
    return plain_keys(model_entries(model))
