"""Every kind of bad payload: ``CORRUPTIONS``, generic mutations of any valid payload, each
with the error class and the key its error must name; and ``copy_payload`` to check that a
corrupt payload was not written to (compare with ``state.assert_same(..., nan_ok=True)``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from fp8state.errors import FP8StateError, SchemaError, SchemaVersionError
from fp8state.schema import as_mapping, default_payload, pack, unpack

KEYS_V1 = frozenset(
    {
        "schema_version",
        "fwd.amax_history",
        "fwd.scale",
        "fwd.scale_inv",
        "bwd.amax_history",
        "bwd.scale",
        "bwd.scale_inv",
        "recipe.fp8_format",
        "recipe.margin",
        "recipe.amax_history_len",
        "recipe.amax_compute_algo",
    }
)

#: Takes a valid payload (a fresh dict the mutation may edit), returns the corrupted input.
Mutation = Callable[[dict[str, Any]], Any]


def fields_of(payload: Any) -> dict[str, Any]:
    """A fresh, editable mapping form of a valid payload (schema 2's tensor or a dict)."""
    if isinstance(payload, torch.Tensor):
        return {k: v.clone() for k, v in as_mapping(payload).items()}
    return dict(payload)


def _packed(edit: Callable[[torch.Tensor], None]) -> Mutation:
    """The payload as schema 2's tensor, then ``edit`` applied to it (its header, its length)."""

    def mutate(p: dict[str, Any]) -> torch.Tensor:
        t = pack(unpack(p))
        edit(t)
        return t

    return mutate


def _set(key: Any, value: Any) -> Mutation:
    """``p[key] = value`` (``value(p)`` if callable)."""

    def mutate(p: dict[str, Any]) -> dict[str, Any]:
        p[key] = value(p) if callable(value) else value
        return p

    return mutate


def _drop(key: str) -> Mutation:
    def mutate(p: dict[str, Any]) -> dict[str, Any]:
        del p[key]
        return p

    return mutate


def _poke(key: str, value: float) -> Mutation:
    """A copy of ``p[key]`` with its last element set to ``value``."""

    def mutate(p: dict[str, Any]) -> dict[str, Any]:
        t = p[key].clone()
        t.view(-1)[-1] = value
        p[key] = t
        return p

    return mutate


def _whole(value: Any) -> Mutation:
    return lambda p: value() if callable(value) else value


def _rows(p: dict[str, Any]) -> int:
    return int(p["fwd.amax_history"].shape[0])


def _n(p: dict[str, Any], d: str) -> int:
    return int(p[f"{d}.scale"].numel())


def _other_gemms(p: dict[str, Any]) -> dict[str, Any]:
    other = fields_of(default_payload(num_gemms=_n(p, "fwd") // 3 + 1, rows=_rows(p)))
    return {**p, **{k: v for k, v in other.items() if k.startswith(("fwd.", "bwd."))}}


def _bwd_slots(extra: int) -> Mutation:
    def mutate(p: dict[str, Any]) -> dict[str, Any]:
        n = _n(p, "bwd") + extra
        return {
            **p,
            "bwd.amax_history": torch.zeros(_rows(p), n),
            "bwd.scale": torch.ones(n),
            "bwd.scale_inv": torch.ones(n),
        }

    return mutate


NAN, INF = float("nan"), float("inf")
T = torch.tensor

#: Every kind of bad input of the acceptance list, as (test id, mutation, error class, text the
#: error's key must contain). Generic: applies to any valid payload of any GEMM and row count.
CORRUPTIONS: list[tuple[str, Mutation, type[FP8StateError], str]] = [
    # not a dict
    ("nondict-list", _whole(lambda: [T(1)]), SchemaError, ""),
    ("nondict-none", _whole(None), SchemaError, ""),
    ("nondict-tensor", _whole(lambda: T(1)), SchemaError, ""),
    ("nondict-te-uint8", _whole(lambda: torch.zeros(4, dtype=torch.uint8)), SchemaError, ""),
    ("nondict-bytes", _whole(b"\x80\x04N."), SchemaError, ""),
    ("nondict-str", _whole("fwd.scale"), SchemaError, ""),
    # keys
    *[(f"missing-{k}", _drop(k), SchemaError, k) for k in sorted(KEYS_V1)],
    ("extra-key", _set("fwd.amax", lambda p: torch.zeros(3)), SchemaError, "fwd.amax"),
    ("extra-key-metadata", _set("__metadata__", lambda p: T(0)), SchemaError, "__metadata__"),
    ("nonstr-key", _set(0, lambda p: T(0)), SchemaError, "0"),
    # extra structure, non-tensor values
    ("nested-dict", _set("fwd", lambda p: {"scale": torch.ones(3)}), SchemaError, "fwd"),
    (
        "nested-dict-value",
        _set("fwd.scale", lambda p: {"v": p["fwd.scale"]}),
        SchemaError,
        "fwd.scale",
    ),
    ("nested-list-value", _set("fwd.scale", lambda p: [p["fwd.scale"]]), SchemaError, "fwd.scale"),
    ("value-list", _set("fwd.scale", lambda p: p["fwd.scale"].tolist()), SchemaError, "fwd.scale"),
    ("value-int", _set("recipe.margin", 1), SchemaError, "recipe.margin"),
    ("value-float", _set("fwd.scale", 1.0), SchemaError, "fwd.scale"),
    ("value-none", _set("bwd.scale_inv", None), SchemaError, "bwd.scale_inv"),
    ("value-str", _set("schema_version", "1"), SchemaError, "schema_version"),
    ("value-numpy", _set("fwd.scale", lambda p: p["fwd.scale"].numpy()), SchemaError, "fwd.scale"),
    ("value-bytes", _set("fwd.amax_history", b"\x00"), SchemaError, "fwd.amax_history"),
    # meta and sparse tensors
    (
        "meta-scale",
        _set("fwd.scale", lambda p: p["fwd.scale"].to("meta")),
        SchemaError,
        "fwd.scale",
    ),
    (
        "meta-history",
        _set("bwd.amax_history", lambda p: p["bwd.amax_history"].to("meta")),
        SchemaError,
        "bwd.amax_history",
    ),
    (
        "meta-version",
        _set("schema_version", lambda p: T(1, device="meta")),
        SchemaError,
        "schema_version",
    ),
    (
        "sparse-history",
        _set("fwd.amax_history", lambda p: p["fwd.amax_history"].to_sparse()),
        SchemaError,
        "fwd.amax_history",
    ),
    # dtypes
    (
        "dtype-scale-f64",
        _set("fwd.scale", lambda p: p["fwd.scale"].double()),
        SchemaError,
        "fwd.scale",
    ),
    (
        "dtype-scale-bf16",
        _set("bwd.scale", lambda p: p["bwd.scale"].bfloat16()),
        SchemaError,
        "bwd.scale",
    ),
    (
        "dtype-scale_inv-i64",
        _set("fwd.scale_inv", lambda p: p["fwd.scale_inv"].long()),
        SchemaError,
        "fwd.scale_inv",
    ),
    (
        "dtype-history-f16",
        _set("bwd.amax_history", lambda p: p["bwd.amax_history"].half()),
        SchemaError,
        "bwd.amax_history",
    ),
    (
        "dtype-version-i32",
        _set("schema_version", lambda p: T(1, dtype=torch.int32)),
        SchemaError,
        "schema_version",
    ),
    ("dtype-version-f32", _set("schema_version", lambda p: T(1.0)), SchemaError, "schema_version"),
    ("dtype-margin-f32", _set("recipe.margin", lambda p: T(0.0)), SchemaError, "recipe.margin"),
    (
        "dtype-format-bool",
        _set("recipe.fp8_format", lambda p: T(True)),
        SchemaError,
        "recipe.fp8_format",
    ),
    # shapes and slot counts
    ("shape-version-1d", _set("schema_version", lambda p: T([1])), SchemaError, "schema_version"),
    (
        "shape-window-1d",
        _set("recipe.amax_history_len", lambda p: T([1])),
        SchemaError,
        "recipe.amax_history_len",
    ),
    ("shape-scale-0d", _set("fwd.scale", lambda p: T(1.0)), SchemaError, "fwd.scale"),
    (
        "shape-scale-2d",
        _set("fwd.scale", lambda p: p["fwd.scale"][:, None]),
        SchemaError,
        "fwd.scale",
    ),
    ("shape-scale-empty", _set("fwd.scale", lambda p: torch.ones(0)), SchemaError, "fwd.scale"),
    (
        "slots-fwd-not-multiple-of-3",
        _set("fwd.scale", lambda p: torch.ones(_n(p, "fwd") + 1)),
        SchemaError,
        "fwd.scale",
    ),
    (
        "slots-bwd-not-multiple-of-2",
        _set("bwd.scale", lambda p: torch.ones(_n(p, "bwd") + 1)),
        SchemaError,
        "bwd.scale",
    ),
    (
        "shape-scale_inv",
        _set("fwd.scale_inv", lambda p: torch.ones(_n(p, "fwd") + 3)),
        SchemaError,
        "fwd.scale_inv",
    ),
    (
        "shape-history-1d",
        _set("fwd.amax_history", lambda p: torch.zeros(_n(p, "fwd"))),
        SchemaError,
        "fwd.amax_history",
    ),
    (
        "shape-history-3d",
        _set("fwd.amax_history", lambda p: p["fwd.amax_history"][..., None]),
        SchemaError,
        "fwd.amax_history",
    ),
    (
        "shape-history-cols",
        _set("fwd.amax_history", lambda p: torch.zeros(_rows(p), _n(p, "fwd") + 3)),
        SchemaError,
        "fwd.amax_history",
    ),
    (
        "shape-history-0-rows",
        _set("fwd.amax_history", lambda p: torch.zeros(0, _n(p, "fwd"))),
        SchemaError,
        "fwd.amax_history",
    ),
    (
        "rows-fwd-bwd-differ",
        _set("bwd.amax_history", lambda p: torch.zeros(_rows(p) + 1, _n(p, "bwd"))),
        SchemaError,
        "bwd.amax_history",
    ),
    ("gemms-fwd-bwd-differ", _bwd_slots(2), SchemaError, "bwd.scale"),
    ("gemms-not-the-modules", _other_gemms, SchemaError, "fwd.scale"),
    # values
    ("scale-nan", _poke("fwd.scale", NAN), SchemaError, "fwd.scale"),
    ("scale-neg", _poke("fwd.scale", -224.0), SchemaError, "fwd.scale"),
    ("scale-zero", _poke("bwd.scale", 0.0), SchemaError, "bwd.scale"),
    ("scale-neg-zero", _poke("bwd.scale", -0.0), SchemaError, "bwd.scale"),
    ("scale-inf", _poke("bwd.scale", INF), SchemaError, "bwd.scale"),
    ("scale_inv-nan", _poke("fwd.scale_inv", NAN), SchemaError, "fwd.scale_inv"),
    ("scale_inv-zero", _poke("bwd.scale_inv", 0.0), SchemaError, "bwd.scale_inv"),
    ("scale_inv-inf", _poke("bwd.scale_inv", INF), SchemaError, "bwd.scale_inv"),
    ("history-nan", _poke("fwd.amax_history", NAN), SchemaError, "fwd.amax_history"),
    ("history-neg", _poke("bwd.amax_history", -1.0), SchemaError, "bwd.amax_history"),
    ("history-inf", _poke("bwd.amax_history", INF), SchemaError, "bwd.amax_history"),
    # recipe codes and window
    (
        "recipe-format-2",
        _set("recipe.fp8_format", lambda p: T(2)),
        SchemaError,
        "recipe.fp8_format",
    ),
    (
        "recipe-format-neg",
        _set("recipe.fp8_format", lambda p: T(-1)),
        SchemaError,
        "recipe.fp8_format",
    ),
    (
        "recipe-algo-2",
        _set("recipe.amax_compute_algo", lambda p: T(2)),
        SchemaError,
        "recipe.amax_compute_algo",
    ),
    ("recipe-margin-neg", _set("recipe.margin", lambda p: T(-1)), SchemaError, "recipe.margin"),
    (
        "recipe-window-0",
        _set("recipe.amax_history_len", lambda p: T(0)),
        SchemaError,
        "recipe.amax_history_len",
    ),
    (
        "recipe-window-gt-rows",
        _set("recipe.amax_history_len", lambda p: T(_rows(p) + 1)),
        SchemaError,
        "recipe.amax_history_len",
    ),
    # versions
    ("version-0", _set("schema_version", lambda p: T(0)), SchemaVersionError, "schema_version"),
    ("version-3", _set("schema_version", lambda p: T(3)), SchemaVersionError, "schema_version"),
    ("version-99", _set("schema_version", lambda p: T(99)), SchemaVersionError, "schema_version"),
    ("version-neg", _set("schema_version", lambda p: T(-7)), SchemaVersionError, "schema_version"),
    # schema 2's tensor form: its header and its length
    ("packed-version-3", _packed(lambda t: t.__setitem__(0, 3.0)), SchemaVersionError, "schema"),
    ("packed-version-1", _packed(lambda t: t.__setitem__(0, 1.0)), SchemaError, "schema"),
    ("packed-version-half", _packed(lambda t: t.__setitem__(0, 2.5)), SchemaError, "schema"),
    ("packed-gemms-0", _packed(lambda t: t.__setitem__(1, 0.0)), SchemaError, "num_gemms"),
    ("packed-rows-more", _packed(lambda t: t.__setitem__(2, t[2] + 1)), SchemaError, "num_gemms"),
    ("packed-margin-nan", _packed(lambda t: t.__setitem__(4, NAN)), SchemaError, "recipe.margin"),
    ("packed-format-9", _packed(lambda t: t.__setitem__(3, 9.0)), SchemaError, "fp8_format"),
    ("packed-scale-neg", _packed(lambda t: t.__setitem__(-1, -1.0)), SchemaError, "bwd.scale_inv"),
    ("packed-truncated", lambda p: pack(unpack(p))[:-1].clone(), SchemaError, "num_gemms"),
    ("packed-header-only", lambda p: pack(unpack(p))[:5].clone(), SchemaError, "schema_version"),
    ("packed-f64", lambda p: pack(unpack(p)).double(), SchemaError, ""),
    ("packed-2d", lambda p: pack(unpack(p))[None], SchemaError, ""),
]


def copy_payload(payload: Any) -> Any:
    """A deep copy of a (possibly corrupt) payload, for checking it was not written to."""
    if isinstance(payload, torch.Tensor):
        return payload.clone() if payload.layout == torch.strided else payload
    if isinstance(payload, dict):
        return {k: copy_payload(v) for k, v in payload.items()}
    return copy.copy(payload)
