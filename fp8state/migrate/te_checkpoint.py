"""Whole-checkpoint conversion: every ``_extra_state`` of a TE checkpoint becomes a payload.

The checkpoint is read with the allow-list unpickler onto the CPU; its structure is returned as
it was read (a state dict, or a dict holding one under ``"model"``, ``"state_dict"`` or
``"module"`` beside optimizer state and the rest). In each state dict:

* an ``_extra_state`` holding FP8 state becomes a schema payload (attention's too);
* one without FP8 state becomes a fresh schema payload where the module's GEMM count is known
  from its parameters (Linear / LayerNormLinear 1, LayerNormMLP 2, GroupedLinear G), so
  ``load_state_dict(strict=True)`` works, and is removed elsewhere (norms, attention);
* every other entry is left alone: tensors stay bit-identical.
"""

from __future__ import annotations

import os
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any

import torch

from fp8state._te.extra_state import decode_te_value
from fp8state._walk import walk
from fp8state.errors import FP8StateError, LegacyFormatError
from fp8state.migrate import migration_report as rpt
from fp8state.migrate.reader import ReadCheckpoint, read_checkpoint
from fp8state.schema import (
    EXTRA_STATE_KEY,
    SCHEMA_VERSION,
    default_payload,
    is_extra_state_key,
    is_payload,
    pack,
    unpack,
)

__all__ = [
    "load_te_checkpoint",
    "migrate_te_checkpoint",
    "convert_te_state_dict",
    "convert_read_checkpoint",
    "infer_num_gemms",
    "STATE_DICT_KEYS",
]

#: Keys under which training scripts commonly nest the model's state dict.
STATE_DICT_KEYS = ("model", "state_dict", "module")
_GROUPED_WEIGHT = re.compile(r"weight\d+")

#: ``progress(keys, total)`` wraps the iteration over a state dict's keys (e.g. with tqdm).
Progress = Callable[[Iterable[str], int], Iterable[str]]
LocationOf = Callable[[torch.Tensor], str | None]


def _members(state_dict: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Entries grouped by module prefix (``"blocks.0.mlp."`` -> ``{"fc1_weight": t, ...}``)."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in state_dict.items():
        if not isinstance(key, str):
            continue
        prefix, _, name = key.rpartition(".")
        groups.setdefault(f"{prefix}." if prefix else "", {})[name] = value
    return groups


def _is_matrix(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 2


def infer_num_gemms(members: Mapping[str, Any]) -> int | None:
    """GEMM count of a TE module from its own state-dict entries, or None if not a GEMM module.

    ``fc1_weight`` + ``fc2_weight``: LayerNormMLP (2). ``weight0`` ... ``weightG-1``:
    GroupedLinear (G). A 2-D ``weight`` or ``*_weight`` (``query_weight``, split Linear), or a
    ``layer_norm_weight`` without matrices (TE v0.1-v0.5 ``layernorm_qkv``, whose weights live on
    the attention module): Linear / LayerNormLinear (1). Anything else (norms, attention): None.

    Example:
        >>> import torch
        >>> from fp8state.migrate import infer_num_gemms
        >>> infer_num_gemms({"fc1_weight": torch.ones(64, 16), "fc2_weight": torch.ones(16, 64)})
        2
        >>> infer_num_gemms({"weight": torch.ones(16, 16), "bias": torch.ones(16)})
        1
        >>> infer_num_gemms({"weight": torch.ones(16)}) is None  # a norm
        True
    """
    if _is_matrix(members.get("fc1_weight")) and _is_matrix(members.get("fc2_weight")):
        return 2
    grouped = [n for n, v in members.items() if _GROUPED_WEIGHT.fullmatch(n) and _is_matrix(v)]
    if grouped:
        return len(grouped)
    matrices = [
        n
        for n, v in members.items()
        if (n == "weight" or n.endswith("_weight")) and n != "layer_norm_weight" and _is_matrix(v)
    ]
    if matrices or "layer_norm_weight" in members:
        return 1
    return None


def _tensors_in(value: object) -> Iterable[torch.Tensor]:
    return (item for _, item in walk(value) if isinstance(item, torch.Tensor))


def _locations(members: Mapping[str, Any], location_of: LocationOf | None) -> set[str]:
    if location_of is None:
        return set()
    found = {location_of(t) for v in members.values() for t in _tensors_in(v)}
    return {tag for tag in found if tag is not None}


def _convert_entry(
    value: object, members: Mapping[str, Any], label: str, location_of: LocationOf | None
) -> tuple[torch.Tensor | None, rpt.EntryReport]:
    """Convert one ``_extra_state`` value; ``members`` are its module's state-dict entries."""
    gemms = infer_num_gemms(members)
    saved = _locations(members, location_of)
    if is_payload(value):
        state = unpack(value, num_gemms=gemms)
        # Kept: the same metadata, written in the current schema (a schema-1 dict becomes the
        # tensor every state-dict tool takes).
        tensor_form = isinstance(value, torch.Tensor)
        packed = value if isinstance(value, torch.Tensor) else pack(state)
        entry = rpt.EntryReport(
            label,
            rpt.KEPT,
            f"fp8state schema v{SCHEMA_VERSION if tensor_form else 1}",
            "tensor" if tensor_form else "dict (written as a schema-2 tensor)",
            state.num_gemms,
            state.rows,
            state.recipe,
            "checkpoint",
            locations=tuple(sorted(saved)),
            payload=packed,
        )
        return packed, entry
    decoded = decode_te_value(value, num_gemms=gemms)
    saved |= decoded.locations
    entry = rpt.EntryReport(
        label,
        rpt.CONVERTED,
        decoded.era,
        decoded.container,
        decoded.num_gemms,
        decoded.rows,
        decoded.recipe,
        decoded.recipe_source,
        decoded.defaulted,
        decoded.notes,
        locations=tuple(sorted(saved)),
        te_slots=decoded.te_slots,
        payload=decoded.payload,
    )
    if decoded.payload is not None:
        return decoded.payload, entry
    if gemms is None:
        entry.action = rpt.DROPPED
        return None, entry
    entry.action, entry.num_gemms = rpt.DEFAULTED, gemms
    entry.payload = default_payload(gemms)
    entry.rows = unpack(entry.payload).rows
    return entry.payload, entry


def _convert(
    state_dict: Mapping[str, Any],
    *,
    strict: bool,
    where: str,
    report: rpt.MigrationReport,
    progress: Progress | None,
    location_of: LocationOf | None,
) -> Mapping[str, Any]:
    groups = _members(state_dict)
    out: OrderedDict[str, Any] | dict[str, Any] = (
        OrderedDict() if isinstance(state_dict, OrderedDict) else {}
    )
    keys: Iterable[str] = list(state_dict)
    if progress is not None:
        keys = progress(keys, len(state_dict))
    for key in keys:
        value = state_dict[key]
        if not (isinstance(key, str) and is_extra_state_key(key)):
            out[key] = value
            report.other_tensors += isinstance(value, torch.Tensor)
            continue
        label = f"{where}/{key}" if where else key
        prefix = key[: -len(EXTRA_STATE_KEY)]
        try:
            payload, entry = _convert_entry(value, groups[prefix], label, location_of)
        except FP8StateError as err:
            if strict:
                raise err.under(label) from None
            payload, entry = None, rpt.EntryReport(label, rpt.FAILED, error=str(err.under(label)))
        report.entries.append(entry)
        if payload is not None:
            out[key] = payload
    _copy_attributes(state_dict, out)
    return out


def _copy_attributes(src: object, dst: Mapping[Any, Any]) -> None:
    # state_dict() attaches per-module version metadata (`_metadata`); load_state_dict reads it.
    if isinstance(dst, OrderedDict):
        dst.__dict__.update(getattr(src, "__dict__", {}))


def _looks_like_state_dict(obj: Mapping[Any, Any]) -> bool:
    return (
        bool(obj)
        and all(isinstance(k, str) for k in obj)
        and any(isinstance(v, torch.Tensor) or is_extra_state_key(k) for k, v in obj.items())
    )


def convert_te_state_dict(
    state_dict: Mapping[str, Any], *, strict: bool = True, progress: Progress | None = None
) -> tuple[Mapping[str, Any], rpt.MigrationReport]:
    """Convert every ``_extra_state`` of an already loaded state dict (see the module docstring).

    The input is not modified. Use this when you loaded a trusted checkpoint yourself;
    :func:`load_te_checkpoint` reads files safely.

    Args:
        state_dict: A TE (or mixed) state dict.
        strict: True: the first bad entry raises, naming its key. False: bad entries are removed
            and reported.
        progress: Optional wrapper around the iteration over keys (a progress bar).

    Returns:
        The converted state dict (same mapping type, same key order) and the report.

    Raises:
        UnsafeCheckpointError, LegacyFormatError, SchemaError: a bad entry (``strict=True``).

    Example:
        >>> import io, torch, fp8state
        >>> from fp8state.migrate import convert_te_state_dict
        >>> te_v1 = io.BytesIO()  # a te.Linear's extra state as TE v1.6-v1.13 saved it
        >>> torch.save({
        ...     "scale_fwd": torch.ones(3), "scale_inv_fwd": torch.ones(3),
        ...     "amax_history_fwd": torch.zeros(1024, 3), "scale_bwd": torch.ones(2),
        ...     "scale_inv_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(1024, 2),
        ...     "extra_fp8_variables": {"num_gemms": 1},
        ... }, te_v1)
        >>> te_state = {"weight": torch.randn(16, 16), "_extra_state": te_v1}
        >>> converted, report = convert_te_state_dict(te_state)
        >>> report.counts(), converted["weight"] is te_state["weight"]
        ({'converted': 1}, True)
        >>> fp8state.Linear(16, 16, bias=False).load_state_dict(converted)
        <All keys matched successfully>
    """
    report = rpt.MigrationReport("<state dict>", strict, [""])
    out = _convert(
        state_dict, strict=strict, where="", report=report, progress=progress, location_of=None
    )
    return out, report


def convert_read_checkpoint(
    read: ReadCheckpoint, *, strict: bool = True, progress: Progress | None = None
) -> tuple[Any, rpt.MigrationReport]:
    """Convert what a reader returned (:func:`migrate_te_checkpoint` without the reading).

    For other readers of checkpoints (``fp8state inspect`` reads DCP folders with one).

    Raises:
        LegacyFormatError: ``read.obj`` holds no state dict; or see :func:`load_te_checkpoint`.
    """
    obj = read.obj
    report = rpt.MigrationReport(read.source, strict)
    if not isinstance(obj, Mapping):
        targets: list[str] = []
    else:
        targets = [k for k in STATE_DICT_KEYS if isinstance(obj.get(k), Mapping)]
        if not targets and _looks_like_state_dict(obj):
            targets = [""]
    if not targets:
        raise LegacyFormatError(
            read.source,
            f"a {type(obj).__name__} with no state dict in it",
            "a state dict, or a dict holding one under 'model', 'state_dict' or 'module'",
            "Save the model's state_dict() (as TE users do) and convert that file.",
        )
    report.state_dicts = targets

    def convert(state_dict: Mapping[str, Any], where: str) -> Mapping[str, Any]:
        return _convert(
            state_dict,
            strict=strict,
            where=where,
            report=report,
            progress=progress,
            location_of=read.location_of,
        )

    if targets == [""]:
        return convert(obj, ""), report
    out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
    for key, value in obj.items():
        out[key] = convert(value, key) if key in targets else value
    _copy_attributes(obj, out)
    return out, report


def migrate_te_checkpoint(
    source: str | os.PathLike[str] | IO[bytes],
    *,
    strict: bool = True,
    progress: Progress | None = None,
) -> tuple[Any, rpt.MigrationReport]:
    """Read a TE (or fp8state) checkpoint safely onto the CPU and convert it, with a report.

    Args:
        source: A path or a binary file object written by ``torch.save``.
        strict: See :func:`load_te_checkpoint`.
        progress: Optional wrapper around the iteration over each state dict's keys.

    Returns:
        ``(checkpoint, report)``: the structure as it was read with every state dict converted.

    Raises:
        See :func:`load_te_checkpoint`.

    Example:
        A TE v1.x checkpoint of a ``te.Linear`` and a norm that never held FP8 state:

        >>> import io, os, tempfile, torch
        >>> from fp8state.migrate import migrate_te_checkpoint
        >>> te_v1 = io.BytesIO()
        >>> torch.save({
        ...     "scale_fwd": torch.ones(3), "scale_inv_fwd": torch.ones(3),
        ...     "amax_history_fwd": torch.zeros(1024, 3), "scale_bwd": torch.ones(2),
        ...     "scale_inv_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(1024, 2),
        ...     "extra_fp8_variables": {"num_gemms": 1},
        ... }, te_v1)
        >>> path = os.path.join(tempfile.mkdtemp(), "te_model.pt")
        >>> torch.save({"model": {"proj.weight": torch.randn(16, 16), "proj._extra_state": te_v1,
        ...                       "norm.weight": torch.ones(16), "norm._extra_state": None},
        ...             "step": 100}, path)
        >>> checkpoint, report = migrate_te_checkpoint(path)
        >>> for entry in report.entries:
        ...     print(entry.action, entry.key, entry.era, entry.defaulted)
        converted model/proj._extra_state E07 ('fp8_format', 'margin', 'amax_compute_algo')
        dropped model/norm._extra_state E01-E03 ()
        >>> print(report.summary().replace(path, "te_model.pt"))
        te_model.pt: 2 extra states (1 converted, 1 dropped); 2 other tensors unchanged
        >>> sorted(checkpoint["model"]), checkpoint["step"]
        (['norm.weight', 'proj._extra_state', 'proj.weight'], 100)
    """
    return convert_read_checkpoint(read_checkpoint(source), strict=strict, progress=progress)


def load_te_checkpoint(
    path_or_file: str | os.PathLike[str] | IO[bytes], *, strict: bool = True
) -> Any:
    """Read a TransformerEngine checkpoint of any era safely, onto the CPU, as fp8state's format.

    No TransformerEngine import and no pickled code runs: the file goes through fp8state's
    allow-list unpickler; storages tagged ``cuda:N`` are read onto the CPU, also on a machine
    without a GPU.

    Args:
        path_or_file: A path or a binary file object written by ``torch.save``.
        strict: True: any bad entry fails the whole load, naming its key. False: bad entries are
            dropped, with one warning listing them.

    Returns:
        What the file holds (a state dict, or a dict holding one under ``"model"``,
        ``"state_dict"`` or ``"module"``) with every ``_extra_state`` converted to the schema (or
        removed where it holds no FP8 state and the module has no GEMMs).

    Raises:
        UnsafeCheckpointError: the file names a global outside the allow-list (nothing ran).
        LegacyFormatError: the file or an entry cannot be decoded.
        SchemaError: an fp8state payload in the file is invalid.

    Example:
        >>> import io, os, tempfile, torch, fp8state
        >>> from fp8state.migrate import load_te_checkpoint
        >>> te_v1 = io.BytesIO()  # a te.Linear's extra state as TE v1.6-v1.13 saved it
        >>> torch.save({
        ...     "scale_fwd": torch.full((3,), 2.0), "scale_inv_fwd": torch.full((3,), 0.5),
        ...     "amax_history_fwd": torch.zeros(1024, 3), "scale_bwd": torch.ones(2),
        ...     "scale_inv_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(1024, 2),
        ...     "extra_fp8_variables": {"num_gemms": 1},
        ... }, te_v1)
        >>> path = os.path.join(tempfile.mkdtemp(), "te_model.pt")
        >>> torch.save({"weight": torch.randn(32, 64), "bias": torch.zeros(32),
        ...             "_extra_state": te_v1}, path)
        >>> layer = fp8state.Linear(64, 32)
        >>> layer.load_state_dict(load_te_checkpoint(path))
        <All keys matched successfully>
        >>> layer.fp8_meta("fwd").scale.tolist()
        [2.0, 2.0, 2.0]
    """
    checkpoint, report = migrate_te_checkpoint(path_or_file, strict=strict)
    failed = report.failed()
    if failed:
        warnings.warn(
            f"fp8state: dropped {len(failed)} undecodable extra state(s): "
            + "; ".join(e.error or e.key for e in failed),
            stacklevel=2,
        )
    return checkpoint
