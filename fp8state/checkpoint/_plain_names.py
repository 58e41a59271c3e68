"""The names a model's weights have in plain PyTorch: canonical keys, fused norms unfused.

A plain key is the key ``get_model_state_dict(model)`` uses (no DDP ``module.``, no
``torch.compile`` ``_orig_mod.``), except for a ``LayerNormLinear`` that ``convert_model``
fused: its ``layer_norm_weight`` / ``layer_norm_bias`` are spelled as the original norm's
``weight`` / ``bias``, so the keys are those of the ``nn.Linear``-based model it came from.
"""

from __future__ import annotations

from fp8state.checkpoint._entries import Entry
from fp8state.convert import FUSED_FROM_ATTR, FusedFrom
from fp8state.errors import CheckpointError

__all__ = ["plain_keys"]

_NORM_PARAMS = {"layer_norm_weight": "weight", "layer_norm_bias": "bias"}


def _norm_name(module_name: str, record: FusedFrom, key: str) -> str:
    """Where the fused norm is now, given where the fused module is (``module_name``).

    The model may be wrapped in something that adds a prefix to every name, or be a part of
    the model convert_model saw (names lose a prefix); the norm moves the same way.
    """
    linear = record.linear
    if module_name == linear:
        return record.norm
    if module_name.endswith("." + linear):  # a wrapper added a prefix
        return module_name[: -len(linear)] + record.norm
    stripped = linear[: len(linear) - len(module_name)] if module_name else linear + "."
    if (not module_name or linear.endswith("." + module_name)) and record.norm.startswith(
        stripped
    ):  # a submodule of the converted model
        return record.norm[len(stripped) :]
    raise CheckpointError(
        key,
        f"a LayerNormLinear at {module_name!r} that convert_model fused from the norm "
        f"{record.norm!r} and the linear layer {linear!r}",
        "the fused module where the linear layer was, with its norm inside the same model",
        "Export the model convert_model converted (or a part holding both original modules). "
        f"To keep TransformerEngine's names instead, delete the module's {FUSED_FROM_ATTR} "
        "attribute.",
    )


def _plain_key(entry: Entry) -> str:
    record = getattr(entry.module, FUSED_FROM_ATTR, None)
    if not isinstance(record, FusedFrom) or entry.name not in _NORM_PARAMS:
        return entry.canonical
    module_name = entry.canonical[: -len(entry.name)].rstrip(".")
    norm = _norm_name(module_name, record, entry.key)
    return f"{norm}.{_NORM_PARAMS[entry.name]}" if norm else _NORM_PARAMS[entry.name]


def plain_keys(entries: list[Entry]) -> dict[str, str]:
    """``{model key: plain key}`` for each of a model's entries (``model_entries(model)``).

    Raises:
        CheckpointError: a fused module no longer fits its record, or two keys would get the
            same plain name.
    """
    out: dict[str, str] = {}
    owner: dict[str, str] = {}
    for entry in entries:
        plain = _plain_key(entry)
        if plain in owner:
            raise CheckpointError(
                entry.key,
                f"the plain name {plain!r}, which {owner[plain]!r} has too",
                "one model key per plain name",
                "A module now sits where convert_model put an nn.Identity for a fused norm; "
                f"delete the fused module's {FUSED_FROM_ATTR} attribute to keep "
                "TransformerEngine's names.",
            )
        owner[plain] = entry.key
        out[entry.key] = plain
    return out
