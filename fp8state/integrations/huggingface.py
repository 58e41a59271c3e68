"""Hugging Face ``transformers``: FP8 metadata through ``save_pretrained``/``from_pretrained``.

A converted model's state dict holds tensors only (schema 2), so ``save_pretrained`` writes
each FP8 module's metadata as one more tensor, ``<module>._extra_state``, beside its weights.
``from_pretrained`` builds the model's plain ``torch.nn`` classes and reports those keys as
unused; :func:`load_fp8_metadata` restores them once the model is converted again.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from fp8state.checkpoint import load_state_dict
from fp8state.errors import CheckpointError
from fp8state.mixin import FP8StateMixin
from fp8state.schema import EXTRA_STATE_KEY, is_extra_state_key

__all__ = ["load_fp8_metadata"]


def _saved_extra_states(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            str(folder),
            "no .safetensors file",
            "a folder written by save_pretrained (safe_serialization, the default)",
            "Pass the folder save_pretrained wrote.",
        )
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if is_extra_state_key(key):
                    found[key] = handle.get_tensor(key)
    return found


def load_fp8_metadata(model: nn.Module, folder: str | os.PathLike[str]) -> list[str]:
    """Restore every FP8 module's metadata from a ``save_pretrained`` folder.

    Call it after ``from_pretrained`` and :func:`fp8state.convert_model` (with the options the
    saved model was converted with). Everything is checked before anything is loaded: a missing
    or invalid payload raises and the model is unchanged.

    Args:
        model: The converted model.
        folder: What ``save_pretrained`` wrote (one ``model.safetensors`` or shards).

    Returns:
        The state-dict keys restored, in the model's order.

    Raises:
        CheckpointError: no safetensors file, or an FP8 module of ``model`` has no metadata in
            the folder (the checkpoint was saved from a model converted otherwise, or from a
            plain one).
        StateDictError: a payload is invalid for its module.

    Example:
        >>> import tempfile, torch, fp8state
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from fp8state.integrations.huggingface import load_fp8_metadata
        >>> config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                      num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
        >>> model = fp8state.convert_model(LlamaForCausalLM(config))
        >>> folder = tempfile.mkdtemp()
        >>> model.save_pretrained(folder)
        >>> again = fp8state.convert_model(LlamaForCausalLM.from_pretrained(folder))
        >>> restored = load_fp8_metadata(again, folder)
        >>> restored[0], len(restored)
        ('model.layers.0.self_attn.q_proj._extra_state', 8)
    """
    where = Path(folder)
    saved = _saved_extra_states(where)
    wanted = [
        f"{name}.{EXTRA_STATE_KEY}" if name else EXTRA_STATE_KEY
        for name, module in model.named_modules()
        if isinstance(module, FP8StateMixin)
    ]
    missing = [key for key in wanted if key not in saved]
    if missing:
        raise CheckpointError(
            ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""),
            f"no FP8 metadata in {where} for {len(missing)} of {len(wanted)} FP8 modules",
            "metadata for every FP8 module of the model",
            "Convert the model as the saved one was converted (the same convert_model options), "
            "or start the FP8 metadata fresh by not calling load_fp8_metadata.",
        )
    load_state_dict(model, {key: saved[key] for key in wanted}, strict=False)
    return wanted
