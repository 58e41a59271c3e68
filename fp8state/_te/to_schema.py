"""The conversion rules: TE's FP8 tensors (any era) -> an fp8state schema payload.

The rules are exact, so two implementations give bit-identical results:

1. Slots. TE v0.1-v0.5 kept 2 forward (input, weight) and 1 backward (grad_output) tensors per
   GEMM; they fill our slots ``3g``, ``3g+1`` and ``2g``. The slots TE did not have (output,
   grad_input) get scale 1, scale_inv 1 and a zero history, as in a fresh module.
2. ``scale`` is copied; ``scale_inv`` is copied where the era stores it, else ``1 / scale`` in
   float32.
3. History: all of TE's ``L`` rows are kept, in our order (row 0 = most recent step).
   TE <= 1.5 rolled at the start of a step: the newest amax is in row 0 and older ones run from
   the last row upwards, so ``ours[0] = te[0]`` and ``ours[k] = te[L-k]``. TE >= 1.6 rolls at
   the end: the newest is in the last row and row 0 is zero, so ``ours[k] = te[L-1-k]``.
4. Recipe: the pickled recipe where the era stores one (E08-E10). Otherwise ``fp8_format`` from
   TE's stored fp8 maxima (448/57344 HYBRID, 448/448 E4M3) when present, and defaults for the
   rest (margin 0, ``"max"``), each defaulted field reported. ``amax_history_len = L`` always.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fp8state._te.decode import TEState
from fp8state._te.standins import TEFormat
from fp8state.errors import LegacyFormatError, RecipeError
from fp8state.formats import Format
from fp8state.recipe import AMAX_COMPUTE_ALGOS, DelayedScaling
from fp8state.schema import DirectionState, FP8State, pack, slots_per_gemm, unpack
from fp8state.slots import BwdSlot, Direction, FwdSlot, bwd_slot, by_direction, fwd_slot

__all__ = ["Converted", "convert", "history_order", "old_slot_columns"]

_FORMATS = {TEFormat.HYBRID: Format.HYBRID, TEFormat.E4M3: Format.E4M3}
_MAXIMA: dict[tuple[Any, ...], Format] = {(448, 57344): Format.HYBRID, (448, 448): Format.E4M3}
_DEFAULTS: dict[str, Any] = {"fp8_format": Format.HYBRID, "margin": 0, "amax_compute_algo": "max"}


@dataclass(frozen=True)
class Converted:
    """A converted extra state and how its recipe was obtained.

    Attributes:
        payload: The schema payload (one CPU float32 tensor, :func:`fp8state.schema.pack`).
        recipe: Its recipe.
        recipe_source: ``"pickled recipe"`` or ``"defaults"`` (pre-v2 eras store none).
        defaulted: Recipe fields that got a default because TE did not store them.
        notes: Anything else worth reporting (a pickled history length that differs from L).
    """

    payload: torch.Tensor
    recipe: DelayedScaling
    recipe_source: str
    defaulted: tuple[str, ...]
    notes: tuple[str, ...]


def history_order(rows: int, update_at_end: bool, device: torch.device) -> torch.Tensor:
    """Row indices into TE's history, most recent step first (rule 3).

    Every tensor made while decoding names its dtype and device: a caller's
    ``torch.device("meta")`` context or ``torch.set_default_dtype`` must not change the result.
    """
    if update_at_end:
        return torch.arange(rows - 1, -1, -1, dtype=torch.long, device=device)
    return torch.tensor([0, *range(rows - 1, 0, -1)], dtype=torch.long, device=device)


def old_slot_columns(direction: Direction, num_gemms: int) -> list[int]:
    """Our slot for each TE v0.1-v0.5 column, in TE's column order (rule 1)."""
    fwd = [fwd_slot(g, r) for g in range(num_gemms) for r in (FwdSlot.INPUT, FwdSlot.WEIGHT)]
    bwd = [bwd_slot(g, BwdSlot.GRAD_OUTPUT) for g in range(num_gemms)]
    return by_direction(direction, fwd, bwd)


def _direction(st: TEState, d: Direction) -> DirectionState:
    device = st.amax_history[d].device
    order = history_order(st.rows, st.era.update_at_end, device)
    history = st.amax_history[d].index_select(0, order)
    scale = st.scale[d]
    inv = st.scale_inv[d]
    scale_inv = inv if inv is not None else torch.reciprocal(scale)
    if not st.era.old_slot_layout:
        return DirectionState(history, scale, scale_inv)  # pack() copies
    n = st.num_gemms * slots_per_gemm(d)
    cols = torch.tensor(old_slot_columns(d, st.num_gemms), dtype=torch.long, device=device)
    full = DirectionState.fresh(st.rows, n, device)
    full.amax_history[:, cols] = history
    full.scale[cols] = scale
    full.scale_inv[cols] = scale_inv
    return full


def _bad_recipe(field: str, found: object, expected: str) -> LegacyFormatError:
    return LegacyFormatError(
        f"['recipe'].{field}",
        repr(found),
        expected,
        "fp8state supports DelayedScaling with E4M3 or HYBRID; convert with another recipe.",
    )


def _from_pickled(fields: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    got: dict[str, Any] = {}
    missing = []
    for name in _DEFAULTS:
        if name not in fields:
            missing.append(name)
            continue
        value = fields[name]
        # Each check looks at the type first: a pickled value may be a tensor or a list, whose
        # comparisons raise or answer with a tensor.
        if name == "fp8_format":
            known = isinstance(value, TEFormat) and value in _FORMATS
            if not known:
                raise _bad_recipe(name, value, "Format.HYBRID or Format.E4M3")
            value = _FORMATS[value]
        elif name == "margin":
            if isinstance(value, float) and value.is_integer():
                value = int(value)  # TE's field is an int; a float 0.0 is the same recipe
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _bad_recipe(name, value, "an int >= 0")
        elif type(value) is not str or value not in AMAX_COMPUTE_ALGOS:
            raise _bad_recipe(name, value, f"one of {AMAX_COMPUTE_ALGOS}")
        got[name] = value
    return got, missing


def _from_maxima(st: TEState) -> tuple[dict[str, Any], list[str]]:
    if st.fp8_max is None:
        return {}, ["fp8_format"]
    maxima: tuple[Any, ...] = tuple(st.fp8_max)
    # Numbers first: a list or dict in the file is unhashable, a tensor compares elementwise.
    numbers = all(type(m) in (int, float) for m in maxima)
    if not numbers or maxima not in _MAXIMA:
        raise LegacyFormatError(
            "['extra_fp8_variables'].fp8_max_bwd",
            f"fp8 maxima {ascii(maxima)[:120]} (fwd, bwd)",
            "(448, 57344) for HYBRID or (448, 448) for E4M3",
            "fp8state supports E4M3 and HYBRID only.",
        )
    return {"fp8_format": _MAXIMA[maxima]}, []


def _recipe(st: TEState) -> tuple[DelayedScaling, str, tuple[str, ...], tuple[str, ...]]:
    notes: list[str] = []
    if st.recipe is not None:
        got, missing = _from_pickled(st.recipe.fields)
        source = "pickled recipe"
        pickled_len = st.recipe.fields.get("amax_history_len")
        # Informational (the history's rows are the window); compared only as a plain int.
        if pickled_len is not None and (type(pickled_len) is not int or pickled_len != st.rows):
            shown = ascii(pickled_len)[:60]
            notes.append(f"pickled amax_history_len {shown} != history rows {st.rows}")
    else:
        got, missing = _from_maxima(st)
        source = "fp8 maxima" if "fp8_format" in got else "defaults"
        missing += [name for name in _DEFAULTS if name not in got and name not in missing]
    fields = {**_DEFAULTS, **got}
    try:
        recipe = DelayedScaling(amax_history_len=st.rows, **fields)
    except RecipeError as err:  # pragma: no cover - every field was checked above
        raise LegacyFormatError(f"['recipe'].{err.key}", err.found, err.expected, err.fix) from None
    ordered = tuple(name for name in _DEFAULTS if name in missing)
    return recipe, source, ordered, tuple(notes)


def convert(st: TEState, *, num_gemms: int | None = None) -> Converted:
    """Apply the conversion rules (module docstring) to one decoded TE state.

    Args:
        st: The decoded state.
        num_gemms: GEMM count of the module it will load into, if known.

    Raises:
        LegacyFormatError: the shapes, TE's stored ``num_gemms`` and ``num_gemms`` disagree, or
            the recipe has no fp8state equivalent.
    """
    if st.te_num_gemms is not None and st.te_num_gemms != st.num_gemms:
        raise LegacyFormatError(
            "['extra_fp8_variables'].num_gemms",
            f"num_gemms {st.te_num_gemms} stored by TE",
            f"{st.num_gemms}, the GEMM count of the stored tensor shapes",
            "The checkpoint is corrupt.",
        )
    if num_gemms is not None and num_gemms != st.num_gemms:
        raise LegacyFormatError(
            "",
            f"FP8 metadata for {st.num_gemms} GEMM(s)",
            f"{num_gemms} GEMM(s), the module's count",
            "Load the entry into the module type that saved it (Linear/LayerNormLinear 1, "
            "LayerNormMLP 2).",
        )
    recipe, source, defaulted, notes = _recipe(st)
    state = FP8State(_direction(st, "fwd"), _direction(st, "bwd"), recipe)
    payload = pack(state)
    unpack(payload, num_gemms=st.num_gemms)  # our output must pass our own schema check
    return Converted(payload, recipe, source, defaulted, notes)
