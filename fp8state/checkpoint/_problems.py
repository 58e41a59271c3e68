"""Many problems, one error: how the checkpoint helpers report everything wrong at once.

Also the problems that several loaders report the same way: a key the model has and the state
dict lacks, and an FP8 module's metadata missing from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

from fp8state.errors import CheckpointError, FP8StateError
from fp8state.schema import is_extra_state_key

#: At most this many problems are spelled out in a message (all stay in ``problems``).
_SHOWN = 20


def summarize(problems: Sequence[FP8StateError]) -> str:
    """One indented line per problem (the first :data:`_SHOWN`), for an error's ``found``."""
    lines = [f"{len(problems)} problem(s):"]
    lines += [f"  - {p}" for p in problems[:_SHOWN]]
    if len(problems) > _SHOWN:
        lines.append(f"  ... and {len(problems) - _SHOWN} more (see the error's .problems)")
    return "\n".join(lines)


def missing_key(key: str) -> CheckpointError:
    """A key of the model that the state dict lacks (``strict=True``)."""
    fix = (
        "Load a checkpoint of this model (this module's extra state included)."
        if is_extra_state_key(key)  # another library's extra state: never skip it silently
        else "Load a checkpoint of this model, or pass strict=False to load the keys that are "
        "there."
    )
    return CheckpointError(
        key,
        "no such key in the state dict",
        "a value for every key of the model (strict=True)",
        fix,
    )


def missing_fp8_metadata(
    key: str, where: str = "state dict", reader: str | None = None
) -> CheckpointError:
    """One FP8 module's ``_extra_state`` missing from a checkpoint.

    Args:
        key: The module's ``_extra_state`` key.
        where: What lacks it (``"state dict"``, ``"checkpoint"``).
        reader: The function that reads such a checkpoint into a state dict, when it is not
            one already (a DCP folder), for the fix.
    """
    read = "" if reader is None else f" once read with {reader}"
    return CheckpointError(
        key,
        f"no FP8 metadata for this module in the {where}",
        "an _extra_state for every FP8 module of the model",
        "The checkpoint was saved from a model built differently, or was edited. Load a "
        "complete checkpoint of this model; a checkpoint with no FP8 metadata at all loads "
        f"with fp8state.checkpoint.load_plain_state_dict{read}, which starts every FP8 "
        "module fresh.",
    )


def no_fp8_metadata(keys: Sequence[str]) -> CheckpointError:
    """The state dict has no ``_extra_state`` at all while the model has FP8 modules."""
    return CheckpointError(
        keys_of_strings(keys),
        f"no _extra_state key at all for the model's {len(keys)} FP8 module(s): a checkpoint "
        "without FP8 metadata (trained without FP8, a Hugging Face file, an nn.Linear "
        "model's state_dict())",
        "an fp8state checkpoint, with an _extra_state for every FP8 module",
        "Load it with fp8state.checkpoint.load_plain_state_dict(model, state_dict) (or "
        "load_safetensors for .safetensors files): every FP8 module starts fresh and every "
        "weight is still checked.",
    )


def keys_of_strings(keys: Sequence[str], limit: int = 5) -> str:
    """``keys`` comma-separated, the first ``limit`` of them, for an error's ``key``."""
    keys = list(dict.fromkeys(keys))
    shown = ", ".join(keys[:limit])
    return shown if len(keys) <= limit else f"{shown}, ... ({len(keys)} keys)"


def keys_of(problems: Sequence[FP8StateError], limit: int = 5) -> str:
    """The problems' keys, comma-separated, for an error's ``key``."""
    return keys_of_strings([p.key for p in problems], limit)
