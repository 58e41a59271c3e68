"""Decode one TransformerEngine ``_extra_state`` value of any era into an fp8state payload.

:func:`decode_te_extra_state` is what ``FP8StateMixin.set_extra_state`` calls for TE values;
:func:`decode_te_value` returns the same payload with what the report and ``fp8state inspect``
need (era, container, recipe source, defaulted fields, saved device tags).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8state._te.containers import open_container
from fp8state._te.decode import NoFP8State, decode_opened
from fp8state._te.to_schema import convert
from fp8state.errors import LegacyFormatError
from fp8state.recipe import DelayedScaling

__all__ = ["DecodedExtraState", "decode_te_value", "decode_te_extra_state"]


@dataclass(frozen=True)
class DecodedExtraState:
    """One decoded TE extra state.

    Attributes:
        payload: The schema payload (one CPU float32 tensor), or None where the value holds
            no FP8 state.
        era: ``"E01"`` ... ``"E07"``, ``"E08-E10"``; for values without state, the eras that
            write that form (``"E09/E10 or ops"``).
        container: How TE stored it (``"uint8 pickle"``, ``"BytesIO archive"``, ``"list"`` ...).
        num_gemms: GEMM count (None without FP8 state).
        rows: TE's history length L (None without FP8 state).
        recipe: The payload's recipe (None without FP8 state).
        recipe_source: ``"pickled recipe"``, ``"fp8 maxima"`` or ``"defaults"``.
        defaulted: Recipe fields TE did not store, given fp8state defaults.
        notes: Why there is no state, what was dropped, other remarks.
        locations: Storage location tags found inside nested data (``"cuda:0"``).
        te_slots: TE's ``(forward, backward)`` FP8 tensor counts before conversion.
    """

    payload: torch.Tensor | None
    era: str
    container: str
    num_gemms: int | None = None
    rows: int | None = None
    recipe: DelayedScaling | None = None
    recipe_source: str = ""
    defaulted: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    locations: frozenset[str] = frozenset()
    te_slots: tuple[int, int] | None = None


def decode_te_value(value: object, *, num_gemms: int | None = None) -> DecodedExtraState:
    """Decode ``value`` like :func:`decode_te_extra_state`, keeping the details.

    Args:
        value: A TE ``_extra_state`` value (see :func:`decode_te_extra_state`).
        num_gemms: The loading module's GEMM count, or None to accept any.

    Returns:
        The payload (or None) with the era, container, recipe source, defaulted recipe fields
        and the device tags found inside the value.

    Raises:
        UnsafeCheckpointError: pickled data names a global outside the allow-list.
        LegacyFormatError: see :func:`decode_te_extra_state`.

    Example:
        What TE v1.6-v1.13 saved for a ``te.Linear``, without the FP8 maxima that would name
        the format:

        >>> import io, torch
        >>> from fp8state.migrate import decode_te_value
        >>> te_v1 = io.BytesIO()
        >>> torch.save({
        ...     "scale_fwd": torch.ones(3), "scale_inv_fwd": torch.ones(3),
        ...     "amax_history_fwd": torch.zeros(4, 3), "scale_bwd": torch.ones(2),
        ...     "scale_inv_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(4, 2),
        ...     "extra_fp8_variables": {"num_gemms": 1},
        ... }, te_v1)
        >>> decoded = decode_te_value(te_v1)
        >>> decoded.era, decoded.container, decoded.num_gemms, decoded.rows
        ('E07', 'BytesIO archive', 1, 4)
        >>> decoded.recipe_source, decoded.defaulted
        ('defaults', ('fp8_format', 'margin', 'amax_compute_algo'))
    """
    opened = open_container(value)
    state = decode_opened(opened)
    if isinstance(state, NoFP8State):
        if (
            num_gemms is not None
            and state.te_num_gemms is not None
            and state.te_num_gemms != num_gemms
        ):
            raise LegacyFormatError(
                "['extra_fp8_variables'].num_gemms",
                f"num_gemms {state.te_num_gemms}",
                f"{num_gemms}, the module's GEMM count",
                "Load the entry into the module type that saved it.",
            )
        return DecodedExtraState(
            None, state.era, opened.container, notes=(state.reason,), locations=opened.locations
        )
    converted = convert(state, num_gemms=num_gemms)
    notes = converted.notes
    if state.dropped:
        notes += (f"dropped TE-only entries: {', '.join(state.dropped)}",)
    return DecodedExtraState(
        converted.payload,
        state.era.code,
        opened.container,
        state.num_gemms,
        state.rows,
        converted.recipe,
        converted.recipe_source,
        converted.defaulted,
        notes,
        opened.locations,
        (int(state.scale["fwd"].numel()), int(state.scale["bwd"].numel())),
    )


def decode_te_extra_state(value: object, *, num_gemms: int | None = None) -> torch.Tensor | None:
    """Decode one TE ``_extra_state`` value of any era (TE v0.1-v2.20) into the schema.

    Neither TransformerEngine nor any pickled code runs: pickled bytes go through fp8state's
    allow-list unpickler. The conversion rules are in ``docs/migration.md``.

    Args:
        value: What TE put under ``<module>._extra_state``: a list or dict of tensors (v0.1-v0.5),
            a uint8 tensor of pickle bytes (v0.6-v0.11, v2.x), an ``io.BytesIO`` holding a
            ``torch.save`` archive (v0.12-v1.13), an empty tensor or None.
        num_gemms: The loading module's GEMM count; the stored shapes (and TE's stored
            ``num_gemms``) must agree with it.

    Returns:
        A schema payload (one CPU float32 tensor) or None where the value holds no FP8
        state (FP8 never ran, a stateless recipe, an ops-based norm).

    Raises:
        UnsafeCheckpointError: pickled data names a global outside the allow-list (nothing ran).
        LegacyFormatError: undecodable data: truncated or random bytes, a wrong structure,
            malformed shapes, non-finite or non-positive scales, non-finite amaxes, a GEMM-count
            mismatch, a recipe fp8state cannot represent.

    Example:
        >>> import io, torch
        >>> from fp8state.migrate import decode_te_extra_state
        >>> te_v1 = io.BytesIO()
        >>> torch.save({
        ...     "scale_fwd": torch.ones(3), "scale_inv_fwd": torch.ones(3),
        ...     "amax_history_fwd": torch.zeros(4, 3), "scale_bwd": torch.ones(2),
        ...     "scale_inv_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(4, 2),
        ...     "extra_fp8_variables": {"num_gemms": 1},
        ... }, te_v1)
        >>> from fp8state.schema import as_mapping
        >>> payload = as_mapping(decode_te_extra_state(te_v1, num_gemms=1))
        >>> payload["fwd.amax_history"].shape, int(payload["recipe.amax_history_len"])
        (torch.Size([4, 3]), 4)
    """
    return decode_te_value(value, num_gemms=num_gemms).payload
