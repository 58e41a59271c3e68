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
from typing import Any

import torch

from fp8state.errors import RecipeError, SchemaError, SchemaVersionError
from fp8state.recipe import DelayedScaling
from fp8state.slots import BWD_SLOTS_PER_GEMM, FWD_SLOTS_PER_GEMM

__all__ = [
    "SCHEMA_VERSION",
    "DIRECTIONS",
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
DIRECTIONS = ("fwd", "bwd")
_TENSOR_FIELDS = ("amax_history", "scale", "scale_inv")
_RECIPE_FIELDS = ("fp8_format", "margin", "amax_history_len", "amax_compute_algo")
#: A payload's keys, in the order :func:`pack` writes them.
PAYLOAD_KEYS = (
    "schema_version",
    *(f"{d}.{f}" for d in DIRECTIONS for f in _TENSOR_FIELDS),
    *(f"recipe.{f}" for f in _RECIPE_FIELDS),
)
_REQUIRED = frozenset(PAYLOAD_KEYS)

Payload = dict[str, torch.Tensor]

#: Upgrade functions: ``UPGRADERS[n]`` turns a version-``n`` payload into a version ``n + 1``
#: payload. Pure: they build a new dict and never modify their argument. Empty at version 1;
#: the first schema change adds ``UPGRADERS[1]``.
UPGRADERS: dict[int, Callable[[Mapping[str, Any]], Payload]] = {}


def slots_per_gemm(direction: str) -> int:
    """3 forward or 2 backward slots per GEMM (TE's layout).

    Example:
        >>> from fp8state.schema import slots_per_gemm
        >>> slots_per_gemm("fwd"), slots_per_gemm("bwd")
        (3, 2)
    """
    return FWD_SLOTS_PER_GEMM if direction == "fwd" else BWD_SLOTS_PER_GEMM


@dataclass(frozen=True)
class DirectionState:
    """Metadata of one direction: ``amax_history (rows, n)``, ``scale (n,)``, ``scale_inv (n,)``."""

    amax_history: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor


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

    def direction(self, name: str) -> DirectionState:
        """``self.fwd`` or ``self.bwd`` by name."""
        return self.fwd if name == "fwd" else self.bwd


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
    parts = [getattr(state.direction(d), f) for d in DIRECTIONS for f in _TENSOR_FIELDS]
    if parts[0].device.type == "cpu":
        host = [p.detach().clone() for p in parts]
    else:
        flat = torch.cat([p.detach().reshape(-1) for p in parts]).to("cpu")
        host = [
            chunk.view(p.shape).clone()
            for chunk, p in zip(flat.split([p.numel() for p in parts]), parts, strict=True)
        ]
    # device="cpu": a `with torch.device(...)` default must not move the payload.
    payload: Payload = {"schema_version": torch.tensor(SCHEMA_VERSION, dtype=torch.int64,
                                                       device="cpu")}
    names = [f"{d}.{f}" for d in DIRECTIONS for f in _TENSOR_FIELDS]
    payload.update(zip(names, host, strict=True))
    for field, value in state.recipe.to_scalars().items():
        payload[f"recipe.{field}"] = torch.tensor(value, dtype=torch.int64, device="cpu")
    return payload


def default_payload(
    num_gemms: int, rows: int = 1024, recipe: DelayedScaling | None = None
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
    recipe = recipe or DelayedScaling(amax_history_len=min(1024, rows))

    def direction(d: str) -> DirectionState:
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
    payload = _upgrade(_check_flat(payload))
    _check_keys(payload)
    recipe = _unpack_recipe(payload)
    fwd = _unpack_direction(payload, "fwd")
    bwd = _unpack_direction(payload, "bwd")
    _check_consistency(fwd, bwd, recipe, num_gemms)
    _check_values(payload)
    return FP8State(fwd, bwd, recipe)


def _key(name: str) -> str:
    return f"[{name!r}]"


def _check_flat(payload: Mapping[Any, Any]) -> Mapping[str, torch.Tensor]:
    for name, value in payload.items():
        # The all-valid case in one test per entry (this runs for every module of a model).
        if type(name) is str and isinstance(value, torch.Tensor) and value.is_cpu \
                and value.layout == torch.strided:
            continue
        if not isinstance(name, str):
            raise SchemaError(
                _key(name), f"a key of type {type(name).__name__}", "string keys only",
                "The payload is not an fp8state extra state.",
            )
        if not isinstance(value, torch.Tensor):
            raise SchemaError(
                _key(name), f"a {type(value).__name__}", "a torch.Tensor (the schema is flat)",
                "Do not nest containers in the payload; see docs/schema.md.",
            )
        if value.is_meta:
            raise SchemaError(
                _key(name), "a tensor on the meta device (it holds no data)",
                "a tensor on a real device",
                "Load the checkpoint itself, not a state_dict() of a model built on 'meta'.",
            )
        if value.layout != torch.strided:
            raise SchemaError(
                _key(name), f"layout {value.layout}", "a dense (strided) tensor",
                "Convert it with .to_dense() before loading.",
            )
    return payload


def _int_scalar(payload: Mapping[str, torch.Tensor], name: str) -> int:
    value = payload[name]
    if value.dtype != torch.int64 or value.dim() != 0:
        raise SchemaError(
            _key(name), f"dtype {value.dtype} with shape {tuple(value.shape)}",
            "a 0-d torch.int64 tensor", "The checkpoint is corrupt or was edited by hand.",
        )
    return int(value.item())


def _upgrade(payload: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    if "schema_version" not in payload:
        raise SchemaError(
            _key("schema_version"), "no such key", "an int64 schema version",
            "The payload is not an fp8state extra state; for a TransformerEngine checkpoint "
            "use `fp8state migrate` or fp8state.migrate.load_te_checkpoint.",
        )
    version = _int_scalar(payload, "schema_version")
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            _key("schema_version"), f"version {version}",
            f"at most version {SCHEMA_VERSION}, the newest this fp8state can read",
            "Upgrade fp8state to read this checkpoint.",
        )
    while version < SCHEMA_VERSION:
        step = UPGRADERS.get(version)
        if step is None:
            raise SchemaVersionError(
                _key("schema_version"), f"version {version}",
                f"a version from 1 to {SCHEMA_VERSION}",
                "No fp8state release wrote this version: the checkpoint is corrupt.",
            )
        payload = step(payload)
        new_version = _int_scalar(payload, "schema_version")
        if new_version != version + 1:
            raise AssertionError(f"upgrader {version} produced version {new_version}")
        version = new_version
    return payload


def _check_keys(payload: Mapping[str, torch.Tensor]) -> None:
    missing = sorted(_REQUIRED - payload.keys())
    extra = sorted(payload.keys() - _REQUIRED)
    if missing:
        raise SchemaError(
            _key(missing[0]), f"missing keys {missing}", f"all of {sorted(_REQUIRED)}",
            "The checkpoint is incomplete; re-save it from the model.",
        )
    if extra:
        raise SchemaError(
            _key(extra[0]), f"unexpected keys {extra}",
            f"only the schema-{SCHEMA_VERSION} keys",
            "A newer writer must raise schema_version; remove keys added by hand.",
        )


def _unpack_recipe(payload: Mapping[str, torch.Tensor]) -> DelayedScaling:
    scalars = {field: _int_scalar(payload, f"recipe.{field}") for field in _RECIPE_FIELDS}
    try:
        return DelayedScaling.from_scalars(scalars)
    except RecipeError as err:
        field = err.key.rsplit(".", 1)[-1]
        raise SchemaError(
            _key(f"recipe.{field}"), err.found, err.expected, err.fix
        ) from None


def _unpack_direction(payload: Mapping[str, torch.Tensor], d: str) -> DirectionState:
    for field in _TENSOR_FIELDS:
        name = f"{d}.{field}"
        if payload[name].dtype != torch.float32:
            raise SchemaError(
                _key(name), f"dtype {payload[name].dtype}", "torch.float32",
                "The checkpoint is corrupt or was edited by hand.",
            )
    hist, scale, scale_inv = (payload[f"{d}.{f}"] for f in _TENSOR_FIELDS)
    n = scale.shape[0] if scale.dim() == 1 else -1
    per = slots_per_gemm(d)
    if scale.dim() != 1 or n == 0 or n % per:
        raise SchemaError(
            _key(f"{d}.scale"), f"shape {tuple(scale.shape)}",
            f"(n,) with n a positive multiple of {per} ({per} slots per GEMM)",
            "The checkpoint is corrupt.",
        )
    if tuple(scale_inv.shape) != (n,):
        raise SchemaError(
            _key(f"{d}.scale_inv"), f"shape {tuple(scale_inv.shape)}", f"({n},) like {d}.scale",
            "The checkpoint is corrupt.",
        )
    if hist.dim() != 2 or hist.shape[0] < 1 or hist.shape[1] != n:
        raise SchemaError(
            _key(f"{d}.amax_history"), f"shape {tuple(hist.shape)}",
            f"(rows >= 1, {n}) matching {d}.scale", "The checkpoint is corrupt.",
        )
    return DirectionState(hist, scale, scale_inv)


def _check_consistency(
    fwd: DirectionState, bwd: DirectionState, recipe: DelayedScaling, num_gemms: int | None
) -> None:
    gemms_fwd = fwd.scale.shape[0] // FWD_SLOTS_PER_GEMM
    gemms_bwd = bwd.scale.shape[0] // BWD_SLOTS_PER_GEMM
    if gemms_fwd != gemms_bwd:
        raise SchemaError(
            _key("bwd.scale"), f"{bwd.scale.shape[0]} backward slots ({gemms_bwd} GEMMs)",
            f"{2 * gemms_fwd} slots, for the {gemms_fwd} GEMMs of the forward direction",
            "The checkpoint is corrupt.",
        )
    if num_gemms is not None and gemms_fwd != num_gemms:
        raise SchemaError(
            _key("fwd.scale"), f"metadata for {gemms_fwd} GEMM(s) ({fwd.scale.shape[0]} slots)",
            f"{num_gemms} GEMM(s) ({FWD_SLOTS_PER_GEMM * num_gemms} slots) for this module",
            "Load the checkpoint into the module type that saved it.",
        )
    rows = fwd.amax_history.shape[0]
    if bwd.amax_history.shape[0] != rows:
        raise SchemaError(
            _key("bwd.amax_history"), f"{bwd.amax_history.shape[0]} rows",
            f"{rows} rows like fwd.amax_history", "The checkpoint is corrupt.",
        )
    if recipe.amax_history_len > rows:
        raise SchemaError(
            _key("recipe.amax_history_len"), str(recipe.amax_history_len),
            f"at most the {rows} rows the history holds", "The checkpoint is corrupt.",
        )


_SCALE_KEYS = tuple(f"{d}.{f}" for d in DIRECTIONS for f in ("scale", "scale_inv"))
_HISTORY_KEYS = tuple(f"{d}.amax_history" for d in DIRECTIONS)


def _check_values(payload: Mapping[str, torch.Tensor]) -> None:
    # The common all-valid case in a handful of ops (and one host sync for a GPU payload):
    # the extremes of every scale and of every history, from one concatenation.
    scales = [payload[k] for k in _SCALE_KEYS]
    flat = torch.cat([*scales, *(payload[k].reshape(-1) for k in _HISTORY_KEYS)])
    split = sum(t.numel() for t in scales)
    lo_s, hi_s, lo_h, hi_h = torch.stack(
        [*torch.aminmax(flat[:split]), *torch.aminmax(flat[split:])]).tolist()
    # min > 0 and max < inf; NaN fails both comparisons. For histories, min >= 0.
    if lo_s > 0 and hi_s < float("inf") and lo_h >= 0 and hi_h < float("inf"):
        return
    for name in (*_SCALE_KEYS, *_HISTORY_KEYS):
        t = payload[name]
        scale_like = name in _SCALE_KEYS
        ok = torch.isfinite(t) & ((t > 0) if scale_like else (t >= 0))
        if not bool(ok.all()):
            bad = t[~ok]
            raise SchemaError(
                _key(name), f"{bad.numel()} invalid value(s), e.g. {bad[0].item()!r}",
                "finite values > 0" if scale_like else "finite values >= 0",
                "The checkpoint is corrupt or came from a diverged run; load an earlier one "
                "or reset this module's FP8 metadata.",
            )
