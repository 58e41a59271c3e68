"""Where a payload's fields sit: their names, and the one float32 tensor schema 2 stores.

A payload has eleven fields (``docs/schema.md``): the schema version, three tensors per direction
and four recipe integers. Schema 1 stored them as a dict under ``<prefix>_extra_state``; schema 2
stores one 1-D ``float32`` tensor there instead (TransformerEngine's way: one tensor per module),
so a model's state dict holds tensors only. The tensor is a header of seven integers, then the
six metadata tensors flattened in :data:`PAYLOAD_KEYS` order:

``[schema_version, num_gemms, rows, fp8_format, margin, amax_history_len, amax_compute_algo,
fwd.amax_history (rows x 3G), fwd.scale (3G), fwd.scale_inv (3G), bwd.amax_history (rows x 2G),
bwd.scale (2G), bwd.scale_inv (2G)]``

Integers up to 2**24 are exact in float32; the header's are far below that. This module only
moves fields between the two forms and checks the tensor's structure; values are checked by
:func:`fp8state.schema.unpack`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from fp8state._payload_checks import layout_problem, payload_key
from fp8state.errors import SchemaError
from fp8state.slots import BWD_SLOTS_PER_GEMM, DIRECTIONS, FWD_SLOTS_PER_GEMM

__all__ = [
    "DirectionState",
    "TENSOR_FIELDS",
    "RECIPE_FIELDS",
    "PAYLOAD_KEYS",
    "HEADER_FIELDS",
    "packed_numel",
    "header_ints",
    "to_packed",
    "from_packed",
    "mapping_tensors",
]


class DirectionState(NamedTuple):
    """Metadata of one direction: ``amax_history (rows, n)``, ``scale (n,)``, ``scale_inv (n,)``.

    A module's live buffers (:meth:`fp8state.FP8StateMixin.fp8_meta`) and a validated payload
    (:func:`fp8state.schema.unpack`) both come as one; it unpacks as ``hist, scale, scale_inv``.
    """

    amax_history: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor

    @classmethod
    def fresh(cls, rows: int, slots: int, device: torch.device | str = "cpu") -> DirectionState:
        """A direction that never ran: zero history, scales and inverse scales of 1.

        float32 on ``device`` whatever the caller's default dtype or device context.
        """
        f32 = torch.float32
        return cls(
            torch.zeros(rows, slots, dtype=f32, device=device),
            torch.ones(slots, dtype=f32, device=device),
            torch.ones(slots, dtype=f32, device=device),
        )


#: The tensors of one direction, in buffer and payload order.
TENSOR_FIELDS: tuple[str, ...] = DirectionState._fields
#: The recipe's integers, in payload order.
RECIPE_FIELDS = ("fp8_format", "margin", "amax_history_len", "amax_compute_algo")
#: A payload's keys, in the order its mapping form and its tensor form hold them.
PAYLOAD_KEYS = (
    "schema_version",
    *(f"{d}.{f}" for d in DIRECTIONS for f in TENSOR_FIELDS),
    *(f"recipe.{f}" for f in RECIPE_FIELDS),
)
_TENSOR_KEYS = PAYLOAD_KEYS[1 : 1 + len(DIRECTIONS) * len(TENSOR_FIELDS)]
_INT_KEYS = ("schema_version", *(f"recipe.{f}" for f in RECIPE_FIELDS))
#: The packed tensor's header, in order: what fixes the shapes of the rest, and the integers.
HEADER_FIELDS = ("schema_version", "num_gemms", "rows", *(f"recipe.{f}" for f in RECIPE_FIELDS))
_SLOTS = FWD_SLOTS_PER_GEMM + BWD_SLOTS_PER_GEMM
#: The largest header integer float32 holds exactly (every integer up to 2**24).
MAX_HEADER_INT = 2**24
#: Schema 1 stored a dict; the tensor form starts at version 2.
FIRST_PACKED_VERSION = 2


def packed_numel(num_gemms: int, rows: int) -> int:
    """Length of the packed tensor of a module with ``num_gemms`` GEMMs and ``rows`` rows."""
    return len(HEADER_FIELDS) + (rows + 2) * _SLOTS * num_gemms


def header_ints(version: int, num_gemms: int, rows: int, recipe: Sequence[int]) -> list[int]:
    """The header's integers in :data:`HEADER_FIELDS` order, each checked to fit float32.

    Raises:
        SchemaError: a value outside ``0 .. MAX_HEADER_INT`` (float32 would store another
            number, so it is refused rather than written).
    """
    header = [version, num_gemms, rows, *recipe]
    for name, value in zip(HEADER_FIELDS, header, strict=True):
        if not 0 <= value <= MAX_HEADER_INT:
            raise SchemaError(
                payload_key(name),
                str(value),
                f"an integer from 0 to {MAX_HEADER_INT} (exact in the float32 header)",
                "Use a recipe (margin, window) and a history length within that range.",
            )
    return header


def to_packed(version: int, recipe: Sequence[int], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new CPU float32 tensor: the header, then ``tensors`` (the six, in order) flattened.

    Args:
        version: The schema version to write.
        recipe: The recipe's integers in :data:`RECIPE_FIELDS` order.
        tensors: ``fwd.amax_history, fwd.scale, fwd.scale_inv, bwd...`` on one device; a
            device's are moved with one transfer, and no device-wide synchronization happens.
    """
    hist = tensors[0]
    header = header_ints(version, hist.shape[1] // FWD_SLOTS_PER_GEMM, hist.shape[0], recipe)
    # device="cpu": a `with torch.device(...)` default must not move the payload.
    head = torch.tensor(header, dtype=torch.float32, device="cpu")
    flat = [t.detach().reshape(-1) for t in tensors]
    if flat[0].device.type == "cpu":
        return torch.cat([head, *flat])  # one copy
    body = torch.cat(flat)  # one device-to-host transfer below
    out = torch.empty(head.numel() + body.numel(), dtype=torch.float32, device="cpu")
    out[: head.numel()] = head
    out[head.numel() :].copy_(body)
    return out


def _header_int(values: list[float], index: int) -> int:
    value = values[index]
    if not float(value).is_integer():
        raise SchemaError(
            payload_key(HEADER_FIELDS[index]),
            repr(value),
            "an integer (the packed tensor's header holds integers)",
            "The checkpoint is corrupt or was edited by hand.",
        )
    return int(value)


def from_packed(value: torch.Tensor) -> dict[str, torch.Tensor]:
    """The mapping form of a packed tensor: views of its six tensors, 0-d int64 integers.

    Raises:
        SchemaError: not a 1-D float32 tensor, a header that is not integers, or a length that
            its header's GEMM and row counts do not give.
    """
    problem = layout_problem(value)
    if problem is not None:
        raise SchemaError(
            "",
            problem,
            "a dense 1-D torch.float32 tensor (fp8state extra-state schema 2)",
            "Pass what an fp8state module's get_extra_state() returned.",
        )
    if value.dtype != torch.float32 or value.dim() != 1:
        raise SchemaError(
            "",
            f"a {value.dtype} tensor of shape {tuple(value.shape)}",
            "a 1-D torch.float32 tensor (fp8state extra-state schema 2)",
            "Pass what an fp8state module's get_extra_state() returned; for a "
            "TransformerEngine checkpoint use `fp8state migrate` or "
            "fp8state.migrate.load_te_checkpoint.",
        )
    n_head = len(HEADER_FIELDS)
    if value.numel() < n_head:
        raise SchemaError(
            payload_key("schema_version"),
            f"a tensor of {value.numel()} values",
            f"at least the {n_head} header values",
            "The checkpoint is corrupt.",
        )
    head = value[:n_head].tolist()
    ints = {name: _header_int(head, i) for i, name in enumerate(HEADER_FIELDS)}
    if ints["schema_version"] < FIRST_PACKED_VERSION:
        raise SchemaError(
            payload_key("schema_version"),
            f"a tensor of version {ints['schema_version']}",
            f"version {FIRST_PACKED_VERSION} or later (version 1 payloads are dicts)",
            "No fp8state release wrote this: the checkpoint is corrupt.",
        )
    gemms, rows = ints["num_gemms"], ints["rows"]
    if gemms < 1 or rows < 1 or value.numel() != packed_numel(gemms, rows):
        expected = packed_numel(gemms, rows) if gemms >= 1 and rows >= 1 else "a valid length"
        raise SchemaError(
            payload_key("num_gemms"),
            f"{value.numel()} values for num_gemms={gemms}, rows={rows}",
            f"{expected} values: num_gemms >= 1, rows >= 1 and the header's length formula",
            "The checkpoint is corrupt.",
        )
    fwd, bwd = FWD_SLOTS_PER_GEMM * gemms, BWD_SLOTS_PER_GEMM * gemms
    shapes = [(rows, fwd), (fwd,), (fwd,), (rows, bwd), (bwd,), (bwd,)]
    sizes = [rows * fwd, fwd, fwd, rows * bwd, bwd, bwd]
    parts = value[n_head:].split(sizes)
    payload = {k: ints[k] for k in _INT_KEYS}
    mapping: dict[str, torch.Tensor] = {
        k: torch.tensor(v, dtype=torch.int64, device="cpu") for k, v in payload.items()
    }
    mapping.update((k, p.view(s)) for k, p, s in zip(_TENSOR_KEYS, parts, shapes, strict=True))
    return {k: mapping[k] for k in PAYLOAD_KEYS}


def mapping_tensors(payload: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The six metadata tensors of a mapping-form payload, in packed order."""
    return [payload[k] for k in _TENSOR_KEYS]
