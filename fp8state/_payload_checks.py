"""Tensor-level checks of an extra-state payload, each raising a SchemaError naming its key.

:func:`fp8state.schema.unpack` runs them in order; they are kept here so that the schema module
stays about the layout and its versions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fp8state.errors import SchemaError
from fp8state.slots import BWD_SLOTS_PER_GEMM, DIRECTIONS, FWD_SLOTS_PER_GEMM

__all__ = [
    "layout_problem",
    "dense_problem",
    "payload_key",
    "check_flat",
    "int_scalar",
    "check_consistency",
    "check_values",
]


def layout_problem(value: torch.Tensor) -> str | None:
    """What keeps ``value`` from being read as a plain strided tensor, or None.

    Nested, sparse, MKL-DNN and quantized tensors each fail in their own way deep inside torch
    when read: one check, asked first, wherever a tensor from a file is about to be read.
    """
    if value.is_nested:
        return "a nested tensor"
    if value.layout != torch.strided:
        return f"a tensor of layout {value.layout}"
    if value.is_quantized:
        return "a quantized tensor"
    return None


def dense_problem(value: torch.Tensor) -> str | None:
    """:func:`layout_problem`, and a tensor on ``meta`` (it holds no data), or None."""
    problem = layout_problem(value)
    if problem is None and value.is_meta:
        return "a tensor on the meta device (it holds no data)"
    return problem


def payload_key(name: object) -> str:
    """How errors name a payload key: ``['fwd.scale']``, ready to go under a state-dict key."""
    return f"[{name!r}]"


def check_flat(payload: Mapping[Any, Any]) -> Mapping[str, torch.Tensor]:
    for name, value in payload.items():
        # The all-valid case in one test per entry (this runs for every module of a model).
        if (
            type(name) is str
            and isinstance(value, torch.Tensor)
            and value.is_cpu
            and value.layout == torch.strided
        ):
            continue
        if not isinstance(name, str):
            raise SchemaError(
                payload_key(name),
                f"a key of type {type(name).__name__}",
                "string keys only",
                "The payload is not an fp8state extra state.",
            )
        if not isinstance(value, torch.Tensor):
            raise SchemaError(
                payload_key(name),
                f"a {type(value).__name__}",
                "a torch.Tensor (the schema is flat)",
                "Do not nest containers in the payload; see docs/schema.md.",
            )
        problem = dense_problem(value)
        if problem is not None:
            raise SchemaError(
                payload_key(name),
                problem,
                "a dense (strided) tensor with data",
                "Load the checkpoint itself (not a state_dict() of a model built on 'meta'); "
                "convert other kinds with .to_dense() or .dequantize().",
            )
    return payload


def int_scalar(payload: Mapping[str, torch.Tensor], name: str) -> int:
    value = payload[name]
    if value.dtype != torch.int64 or value.dim() != 0:
        raise SchemaError(
            payload_key(name),
            f"dtype {value.dtype} with shape {tuple(value.shape)}",
            "a 0-d torch.int64 tensor",
            "The checkpoint is corrupt or was edited by hand.",
        )
    return int(value.item())


def check_consistency(
    fwd: Sequence[torch.Tensor], bwd: Sequence[torch.Tensor], window: int, num_gemms: int | None
) -> None:
    """Both directions' tensors (history, scale, scale_inv) agree; the window fits the rows."""
    fwd_hist, fwd_scale, _ = fwd
    bwd_hist, bwd_scale, _ = bwd
    gemms_fwd = fwd_scale.shape[0] // FWD_SLOTS_PER_GEMM
    gemms_bwd = bwd_scale.shape[0] // BWD_SLOTS_PER_GEMM
    if gemms_fwd != gemms_bwd:
        raise SchemaError(
            payload_key("bwd.scale"),
            f"{bwd_scale.shape[0]} backward slots ({gemms_bwd} GEMMs)",
            f"{2 * gemms_fwd} slots, for the {gemms_fwd} GEMMs of the forward direction",
            "The checkpoint is corrupt.",
        )
    if num_gemms is not None and gemms_fwd != num_gemms:
        raise SchemaError(
            payload_key("fwd.scale"),
            f"metadata for {gemms_fwd} GEMM(s) ({fwd_scale.shape[0]} slots)",
            f"{num_gemms} GEMM(s) ({FWD_SLOTS_PER_GEMM * num_gemms} slots) for this module",
            "Load the checkpoint into the module type that saved it.",
        )
    rows = fwd_hist.shape[0]
    if bwd_hist.shape[0] != rows:
        raise SchemaError(
            payload_key("bwd.amax_history"),
            f"{bwd_hist.shape[0]} rows",
            f"{rows} rows like fwd.amax_history",
            "The checkpoint is corrupt.",
        )
    if window > rows:
        raise SchemaError(
            payload_key("recipe.amax_history_len"),
            str(window),
            f"at most the {rows} rows the history holds",
            "The checkpoint is corrupt.",
        )


_SCALE_KEYS = tuple(f"{d}.{f}" for d in DIRECTIONS for f in ("scale", "scale_inv"))
_HISTORY_KEYS = tuple(f"{d}.amax_history" for d in DIRECTIONS)


def check_values(payload: Mapping[str, torch.Tensor]) -> None:
    # The common all-valid case in a handful of ops (and one host sync for a GPU payload):
    # the extremes of every scale and of every history, from one concatenation.
    scales = [payload[k] for k in _SCALE_KEYS]
    flat = torch.cat([*scales, *(payload[k].reshape(-1) for k in _HISTORY_KEYS)])
    split = sum(t.numel() for t in scales)
    lo_s, hi_s, lo_h, hi_h = torch.stack(
        [*torch.aminmax(flat[:split]), *torch.aminmax(flat[split:])]
    ).tolist()
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
                payload_key(name),
                f"{bad.numel()} invalid value(s), e.g. {bad[0].item()!r}",
                "finite values > 0" if scale_like else "finite values >= 0",
                "The checkpoint is corrupt or came from a diverged run; load an earlier one "
                "or reset this module's FP8 metadata.",
            )
