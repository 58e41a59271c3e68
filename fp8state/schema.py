"""The extra-state schema: a module's FP8 metadata as one tensor, and back, validated.

The payload is specified in ``docs/schema.md``. It has eleven fields: ``schema_version``,
``{fwd,bwd}.{amax_history,scale,scale_inv}`` (float32) and ``recipe.{fp8_format,margin,
amax_history_len,amax_compute_algo}`` (integers). Version 2 stores them as one 1-D float32 tensor
under ``<prefix>_extra_state`` (:mod:`fp8state._layout`), so a model's state dict holds tensors
only and safetensors, Hugging Face, Accelerate and ``torch.distributed.checkpoint`` take it as
they take any weight. Version 1 stored the same fields as a dict of tensors; it still loads.

Reading goes: open the tensor form, or upgrade an older dict step by step (pure functions in
:data:`UPGRADERS`), refuse newer versions, then validate every key, dtype, shape and value
before anything is returned. :func:`as_mapping` gives the fields by name, for reading.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fp8state._layout import (
    MAX_HEADER_INT,
    PAYLOAD_KEYS,
    RECIPE_FIELDS,
    TENSOR_FIELDS,
    DirectionState,
    from_packed,
    to_packed,
)
from fp8state._payload_checks import (
    check_consistency,
    check_flat,
    check_values,
    int_scalar,
    payload_key,
)
from fp8state.errors import RecipeError, SchemaError, SchemaVersionError
from fp8state.recipe import DEFAULT_HISTORY_ROWS, DelayedScaling
from fp8state.slots import (
    BWD_SLOTS_PER_GEMM,
    DIRECTIONS,
    FWD_SLOTS_PER_GEMM,
    Direction,
    by_direction,
)

__all__ = [
    "SCHEMA_VERSION",
    "EXTRA_STATE_KEY",
    "is_extra_state_key",
    "DIRECTIONS",
    "TENSOR_FIELDS",
    "PAYLOAD_KEYS",
    "UPGRADERS",
    "DirectionState",
    "FP8State",
    "pack",
    "unpack",
    "as_mapping",
    "is_payload",
    "default_payload",
    "slots_per_gemm",
]

SCHEMA_VERSION = 2
#: The state-dict key suffix of a module's extra state (PyTorch's name for it).
EXTRA_STATE_KEY = "_extra_state"


def is_extra_state_key(key: object) -> bool:
    """True for ``"_extra_state"`` and ``"<module>._extra_state"``.

    Example:
        >>> from fp8state.schema import is_extra_state_key
        >>> is_extra_state_key("blocks.0._extra_state"), is_extra_state_key("blocks.0.weight")
        (True, False)
    """
    return isinstance(key, str) and (key == EXTRA_STATE_KEY or key.endswith("." + EXTRA_STATE_KEY))


_REQUIRED = frozenset(PAYLOAD_KEYS)

Payload = dict[str, torch.Tensor]


def _upgrade_1_to_2(payload: Mapping[str, Any]) -> Payload:
    """Version 2 holds the same fields; only where they sit in a state dict changed."""
    upgraded = dict(payload)
    upgraded["schema_version"] = torch.tensor(2, dtype=torch.int64, device="cpu")
    return upgraded


#: Upgrade functions: ``UPGRADERS[n]`` turns a version-``n`` mapping into a version ``n + 1``
#: mapping. Pure: they build a new dict and never modify their argument.
UPGRADERS: dict[int, Callable[[Mapping[str, Any]], Payload]] = {1: _upgrade_1_to_2}


def is_payload(value: object) -> bool:
    """True for an fp8state payload: schema 2's float32 tensor or a dict with a version.

    TransformerEngine's forms are uint8 tensors, ``io.BytesIO``, dicts without a
    ``schema_version``, lists, None, and (v1.13) an *empty* float32 tensor: none of them is one.

    Example:
        >>> import torch
        >>> from fp8state.schema import default_payload, is_payload
        >>> is_payload(default_payload(num_gemms=1)), is_payload(torch.empty(0, dtype=torch.uint8))
        (True, False)
    """
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.float32 and value.dim() == 1 and value.numel() > 0
    return isinstance(value, Mapping) and "schema_version" in value


def slots_per_gemm(direction: Direction) -> int:
    """3 forward or 2 backward slots per GEMM (TE's layout).

    Example:
        >>> from fp8state.schema import slots_per_gemm
        >>> slots_per_gemm("fwd"), slots_per_gemm("bwd")
        (3, 2)
    """
    return by_direction(direction, FWD_SLOTS_PER_GEMM, BWD_SLOTS_PER_GEMM)


@dataclass(frozen=True)
class FP8State:
    """A validated payload: both directions and the recipe that produced them.

    Example:
        >>> from fp8state.schema import default_payload, unpack
        >>> state = unpack(default_payload(num_gemms=2, rows=8))
        >>> state.num_gemms, state.rows, tuple(state.direction("bwd").amax_history.shape)
        (2, 8, (8, 4))
    """

    fwd: DirectionState
    bwd: DirectionState
    recipe: DelayedScaling

    @property
    def rows(self) -> int:
        """Number of history rows stored (the same in both directions)."""
        return int(self.fwd.amax_history.shape[0])

    @property
    def num_gemms(self) -> int:
        """GEMM count implied by the slot counts."""
        return int(self.fwd.scale.shape[0]) // FWD_SLOTS_PER_GEMM

    def direction(self, name: Direction) -> DirectionState:
        """``self.fwd`` or ``self.bwd`` by name."""
        return by_direction(name, self.fwd, self.bwd)

    def as_mapping(self) -> Payload:
        """The fields by payload key (the state's own tensors; integers as 0-d int64)."""
        out: Payload = {
            "schema_version": torch.tensor(SCHEMA_VERSION, dtype=torch.int64, device="cpu")
        }
        for d in DIRECTIONS:
            out.update(
                (f"{d}.{f}", t) for f, t in zip(TENSOR_FIELDS, self.direction(d), strict=True)
            )
        for field, value in self.recipe.to_scalars().items():
            out[f"recipe.{field}"] = torch.tensor(value, dtype=torch.int64, device="cpu")
        return out


def pack(state: FP8State) -> torch.Tensor:
    """Return the schema payload of ``state``: one new CPU float32 tensor (``docs/schema.md``).

    Device tensors are concatenated and moved in one device-to-host transfer; no device-wide
    synchronization happens (the copy waits only for the current stream).

    Example:
        >>> import torch
        >>> from fp8state.schema import default_payload, pack, unpack
        >>> payload = default_payload(num_gemms=1, rows=4)
        >>> payload.dtype, tuple(payload.shape)  # 7 header values, (4 + 2) rows of 5 slots
        (torch.float32, (37,))
        >>> torch.equal(pack(unpack(payload)), payload)
        True
    """
    tensors = [getattr(state.direction(d), f) for d in DIRECTIONS for f in TENSOR_FIELDS]
    return to_packed(SCHEMA_VERSION, list(state.recipe.to_scalars().values()), tensors)


def as_mapping(payload: object, *, num_gemms: int | None = None) -> Payload:
    """The fields of a payload (any version, validated) by key, for reading.

    Example:
        >>> from fp8state.schema import as_mapping, default_payload
        >>> fields = as_mapping(default_payload(num_gemms=1, rows=4))
        >>> tuple(fields["fwd.amax_history"].shape), int(fields["recipe.amax_history_len"])
        ((4, 3), 4)
    """
    return unpack(payload, num_gemms=num_gemms).as_mapping()


def default_payload(
    num_gemms: int, rows: int = DEFAULT_HISTORY_ROWS, recipe: DelayedScaling | None = None
) -> torch.Tensor:
    """Payload of a module that never ran in FP8: zero histories, scales and scale_invs of 1.

    Example:
        >>> from fp8state.schema import default_payload
        >>> from fp8state.schema import as_mapping
        >>> payload = as_mapping(default_payload(num_gemms=2, rows=4))
        >>> tuple(payload["fwd.amax_history"].shape), payload["bwd.scale"].tolist()
        ((4, 6), [1.0, 1.0, 1.0, 1.0])
        >>> int(payload["schema_version"]), int(payload["recipe.amax_history_len"])
        (2, 4)
    """
    recipe = recipe or DelayedScaling(amax_history_len=min(DEFAULT_HISTORY_ROWS, rows))

    def direction(d: Direction) -> DirectionState:
        return DirectionState.fresh(rows, num_gemms * slots_per_gemm(d))

    return pack(FP8State(direction("fwd"), direction("bwd"), recipe))


def unpack(payload: object, *, num_gemms: int | None = None) -> FP8State:
    """Validate a payload of any known schema version and return its contents.

    Args:
        payload: What ``get_extra_state`` returned (schema 2's tensor), possibly after a
            save/load round trip, or a schema-1 dict of tensors. Tensors may be on any real
            device; they are not copied.
        num_gemms: GEMM count the payload must have (the loading module's), or None to accept
            any consistent count.

    Returns:
        The validated state; its tensors are the payload's own (no copies).

    Raises:
        SchemaVersionError: the version is unknown (< 1 without an upgrade path, or newer than
            :data:`SCHEMA_VERSION`).
        SchemaError: anything else does not follow the schema. The error's key is the payload
            key at fault (``"['fwd.scale']"``), ready to be put under a state-dict key.

    Example:
        >>> from fp8state.errors import SchemaError
        >>> from fp8state.schema import default_payload, unpack
        >>> payload = default_payload(num_gemms=1)
        >>> unpack(payload).recipe.amax_history_len
        1024
        >>> try:
        ...     unpack(payload, num_gemms=2)  # a Linear's payload for a LayerNormMLP
        ... except SchemaError as err:
        ...     print(err.key, "|", err.found)
        ['fwd.scale'] | metadata for 1 GEMM(s) (3 slots)
    """
    if isinstance(payload, torch.Tensor):
        if payload.is_meta:
            raise SchemaError(
                "",
                "a tensor on the meta device (no data)",
                "a tensor with data, on any real device",
                "Load the checkpoint from a file, not from a model still on the meta device.",
            )
        payload = from_packed(payload)
    if not isinstance(payload, Mapping):
        raise SchemaError(
            "",
            f"a {type(payload).__name__}",
            "a 1-D float32 tensor (fp8state extra-state schema 2) or a schema-1 dict",
            "Pass what an fp8state module's get_extra_state() returned; for a "
            "TransformerEngine checkpoint use fp8state.migrate.load_te_checkpoint.",
        )
    payload = _upgrade(check_flat(payload))
    _check_keys(payload)
    recipe = _unpack_recipe(payload)
    fwd = _unpack_direction(payload, "fwd")
    bwd = _unpack_direction(payload, "bwd")
    check_consistency(fwd, bwd, recipe.amax_history_len, num_gemms)
    check_values(payload)
    return FP8State(fwd, bwd, recipe)


def _upgrade(payload: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if "schema_version" not in payload:
        raise SchemaError(
            payload_key("schema_version"),
            "no such key",
            "an int64 schema version",
            "The payload is not an fp8state extra state; for a TransformerEngine checkpoint "
            "use `fp8state migrate` or fp8state.migrate.load_te_checkpoint.",
        )
    version = int_scalar(payload, "schema_version")
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            payload_key("schema_version"),
            f"version {version}",
            f"at most version {SCHEMA_VERSION}, the newest this fp8state can read",
            "Upgrade fp8state to read this checkpoint.",
        )
    while version < SCHEMA_VERSION:
        step = UPGRADERS.get(version)
        if step is None:
            raise SchemaVersionError(
                payload_key("schema_version"),
                f"version {version}",
                f"a version from 1 to {SCHEMA_VERSION}",
                "No fp8state release wrote this version: the checkpoint is corrupt.",
            )
        payload = step(payload)
        new_version = int_scalar(payload, "schema_version")
        if new_version != version + 1:
            raise AssertionError(f"upgrader {version} produced version {new_version}")
        version = new_version
    return payload


def _check_keys(payload: Mapping[str, torch.Tensor]) -> None:
    missing = sorted(_REQUIRED - payload.keys())
    extra = sorted(payload.keys() - _REQUIRED)
    if missing:
        raise SchemaError(
            payload_key(missing[0]),
            f"missing keys {missing}",
            f"all of {sorted(_REQUIRED)}",
            "The checkpoint is incomplete; re-save it from the model.",
        )
    if extra:
        raise SchemaError(
            payload_key(extra[0]),
            f"unexpected keys {extra}",
            "only the schema's keys",
            "A newer writer must raise schema_version; remove keys added by hand.",
        )


def _unpack_recipe(payload: Mapping[str, torch.Tensor]) -> DelayedScaling:
    scalars = {field: int_scalar(payload, f"recipe.{field}") for field in RECIPE_FIELDS}
    for field, value in scalars.items():
        if value > MAX_HEADER_INT:  # schema 2 could not store it exactly
            raise SchemaError(
                payload_key(f"recipe.{field}"),
                str(value),
                f"at most {MAX_HEADER_INT}",
                "The checkpoint is corrupt or was edited by hand.",
            )
    try:
        return DelayedScaling.from_scalars(scalars)
    except RecipeError as err:
        field = err.key.rsplit(".", 1)[-1]
        raise SchemaError(
            payload_key(f"recipe.{field}"), err.found, err.expected, err.fix
        ) from None


def _unpack_direction(payload: Mapping[str, torch.Tensor], d: Direction) -> DirectionState:
    for field in TENSOR_FIELDS:
        name = f"{d}.{field}"
        if payload[name].dtype != torch.float32:
            raise SchemaError(
                payload_key(name),
                f"dtype {payload[name].dtype}",
                "torch.float32",
                "The checkpoint is corrupt or was edited by hand.",
            )
    hist, scale, scale_inv = (payload[f"{d}.{f}"] for f in TENSOR_FIELDS)
    n = scale.shape[0] if scale.dim() == 1 else -1
    per = slots_per_gemm(d)
    if scale.dim() != 1 or n == 0 or n % per:
        raise SchemaError(
            payload_key(f"{d}.scale"),
            f"shape {tuple(scale.shape)}",
            f"(n,) with n a positive multiple of {per} ({per} slots per GEMM)",
            "The checkpoint is corrupt.",
        )
    if tuple(scale_inv.shape) != (n,):
        raise SchemaError(
            payload_key(f"{d}.scale_inv"),
            f"shape {tuple(scale_inv.shape)}",
            f"({n},) like {d}.scale",
            "The checkpoint is corrupt.",
        )
    if hist.dim() != 2 or hist.shape[0] < 1 or hist.shape[1] != n:
        raise SchemaError(
            payload_key(f"{d}.amax_history"),
            f"shape {tuple(hist.shape)}",
            f"(rows >= 1, {n}) matching {d}.scale",
            "The checkpoint is corrupt.",
        )
    return DirectionState(hist, scale, scale_inv)
