"""The extra-state schema: pack FP8 metadata into a flat ``dict[str, Tensor]`` and read it back.

The payload is specified in ``docs/schema.md``. In short (version 1): ``schema_version`` (int64,
0-d), ``{fwd,bwd}.{amax_history,scale,scale_inv}`` (float32) and ``recipe.{fp8_format,margin,
amax_history_len,amax_compute_algo}`` (int64, 0-d). Only tensors, so ``torch.load(weights_only=
True)``, safetensors and ``torch.distributed.checkpoint`` all read it.

Reading goes: upgrade older versions step by step (pure functions in :data:`UPGRADERS`), refuse
newer ones, then validate every key, dtype, shape and value before anything is returned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

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
    "default_payload",
    "slots_per_gemm",
]

SCHEMA_VERSION = 1
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


class DirectionState(NamedTuple):
    """Metadata of one direction: ``amax_history (rows, n)``, ``scale (n,)``, ``scale_inv (n,)``.

    A module's live buffers (:meth:`fp8state.FP8StateMixin.fp8_meta`) and a validated payload
    (:func:`unpack`) both come as one; it unpacks as ``hist, scale, scale_inv``.
    """

    amax_history: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor


#: The tensors of one direction, in buffer and payload order.
TENSOR_FIELDS: tuple[str, ...] = DirectionState._fields
_RECIPE_FIELDS = ("fp8_format", "margin", "amax_history_len", "amax_compute_algo")
#: A payload's keys, in the order :func:`pack` writes them.
PAYLOAD_KEYS = (
    "schema_version",
    *(f"{d}.{f}" for d in DIRECTIONS for f in TENSOR_FIELDS),
    *(f"recipe.{f}" for f in _RECIPE_FIELDS),
)
_REQUIRED = frozenset(PAYLOAD_KEYS)

Payload = dict[str, torch.Tensor]

#: Upgrade functions: ``UPGRADERS[n]`` turns a version-``n`` payload into a version ``n + 1``
#: payload. Pure: they build a new dict and never modify their argument. Empty at version 1;
#: the first schema change adds ``UPGRADERS[1]``.
UPGRADERS: dict[int, Callable[[Mapping[str, Any]], Payload]] = {}


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


def pack(state: FP8State) -> Payload:
    """Return the schema payload of ``state``: CPU tensors that share no storage with it.

    Device tensors are concatenated and moved in one device-to-host transfer; no device-wide
    synchronization happens (the copy waits only for the current stream).

    Example:
        >>> import torch
        >>> from fp8state.schema import default_payload, pack, unpack
        >>> payload = default_payload(num_gemms=1, rows=4)
        >>> again = pack(unpack(payload))
        >>> sorted(again) == sorted(payload)
        True
        >>> all(torch.equal(again[k], payload[k]) for k in payload)
        True
    """
    parts = [getattr(state.direction(d), f) for d in DIRECTIONS for f in TENSOR_FIELDS]
    if parts[0].device.type == "cpu":
        host = [p.detach().clone() for p in parts]
    else:
        flat = torch.cat([p.detach().reshape(-1) for p in parts]).to("cpu")
        host = [
            chunk.view(p.shape).clone()
            for chunk, p in zip(flat.split([p.numel() for p in parts]), parts, strict=True)
        ]
    # device="cpu": a `with torch.device(...)` default must not move the payload.
    payload: Payload = {
        "schema_version": torch.tensor(SCHEMA_VERSION, dtype=torch.int64, device="cpu")
    }
    names = [f"{d}.{f}" for d in DIRECTIONS for f in TENSOR_FIELDS]
    payload.update(zip(names, host, strict=True))
    for field, value in state.recipe.to_scalars().items():
        payload[f"recipe.{field}"] = torch.tensor(value, dtype=torch.int64, device="cpu")
    return payload


def default_payload(
    num_gemms: int, rows: int = DEFAULT_HISTORY_ROWS, recipe: DelayedScaling | None = None
) -> Payload:
    """Payload of a module that never ran in FP8: zero histories, scales and scale_invs of 1.

    Example:
        >>> from fp8state.schema import default_payload
        >>> payload = default_payload(num_gemms=2, rows=4)
        >>> tuple(payload["fwd.amax_history"].shape), payload["bwd.scale"].tolist()
        ((4, 6), [1.0, 1.0, 1.0, 1.0])
        >>> int(payload["schema_version"]), int(payload["recipe.amax_history_len"])
        (1, 4)
    """
    recipe = recipe or DelayedScaling(amax_history_len=min(DEFAULT_HISTORY_ROWS, rows))

    def direction(d: Direction) -> DirectionState:
        n = num_gemms * slots_per_gemm(d)
        return DirectionState(torch.zeros(rows, n), torch.ones(n), torch.ones(n))

    return pack(FP8State(direction("fwd"), direction("bwd"), recipe))


def unpack(payload: object, *, num_gemms: int | None = None) -> FP8State:
    """Validate a payload of any known schema version and return its contents.

    Args:
        payload: What ``get_extra_state`` returned, possibly after a save/load round trip.
            Tensors may be on any real device; they are not copied.
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
    if not isinstance(payload, Mapping):
        raise SchemaError(
            "",
            f"a {type(payload).__name__}",
            "a dict[str, Tensor] (fp8state extra-state schema)",
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
            f"only the schema-{SCHEMA_VERSION} keys",
            "A newer writer must raise schema_version; remove keys added by hand.",
        )


def _unpack_recipe(payload: Mapping[str, torch.Tensor]) -> DelayedScaling:
    scalars = {field: int_scalar(payload, f"recipe.{field}") for field in _RECIPE_FIELDS}
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
