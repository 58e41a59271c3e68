"""Tell TransformerEngine extra-state forms apart: the one place that sniffs TE's layouts.

Two questions, one per stage of reading: :func:`describe_te_value` names the form a state
dict's value has on the outside (without unpickling anything: for error messages and
``find_legacy_extra_states``), and :func:`era_of_dict` names the era of a dict once its
container is open (which keys TE wrote, ``te_formats.md`` section 2).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fp8state._te.containers import BYTESIO, DICT

__all__ = ["describe_te_value", "era_of_dict"]

# TransformerEngine dict keys of the v0.3-v1.13 extra state, and the v2 recipe key.
_TE_DICT_KEYS = frozenset({"scale_fwd", "amax_history_fwd", "recipe", "extra_fp8_variables"})
_PICKLE_PROTO = 0x80  # first byte of a pickle of protocol 2 or newer
_INV_KEYS = ("scale_inv_fwd", "scale_inv_bwd")  # eras E05-E07 store them


def describe_te_value(value: object) -> str | None:
    """Name the TransformerEngine extra-state form ``value`` looks like, or None."""
    if value is None:
        return "None (TransformerEngine <= 0.5, FP8 never used)"
    if isinstance(value, list):
        return f"a list of {len(value)} items (TransformerEngine 0.1-0.2)"
    if isinstance(value, Mapping) and "schema_version" not in value:
        if _TE_DICT_KEYS & {k for k in value if isinstance(k, str)}:
            return "a dict of TransformerEngine FP8 metadata (TransformerEngine 0.3-0.5)"
        return None
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1:
        if value.numel() == 0:
            return "an empty uint8 tensor (TransformerEngine >= 2.4, FP8 unused)"
        if int(value[0]) == _PICKLE_PROTO:
            return "a uint8 tensor of pickled bytes (TransformerEngine 0.6-0.11 or >= 2.0)"
    return None


def era_of_dict(container: str, keys: set[str]) -> str:
    """The era code (``"E02"``-``"E07"``) of an opened TE dict with ``keys``, by its container."""
    if "global_fp8_recompute_buffer" in keys:
        return "E02"
    has_inv = any(k in keys for k in _INV_KEYS)
    if not has_inv:
        return "E03" if container == DICT else "E04"
    if "global_fp8_state" in keys:
        return "E06"
    if "global_fp8_buffer" in keys:
        return "E06" if container == BYTESIO else "E05"
    return "E07"
