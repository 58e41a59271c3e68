"""Save and restore one FP8 module's metadata: the work behind get/set_extra_state.

Kept apart from :mod:`fp8state.mixin` so the mixin stays about what a module holds and how
scaling runs; this file is about payloads: building one, checking one against a module, and
copying a checked one onto the module's own device.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fp8state._runtime.buffers import buffer_name
from fp8state._runtime.friend import FP8Friend
from fp8state._runtime.generation import bump_buffer_generation
from fp8state.errors import ConfigError
from fp8state.schema import (
    DIRECTIONS,
    TENSOR_FIELDS,
    DirectionState,
    FP8State,
    is_payload,
    pack,
    slots_per_gemm,
    unpack,
)

__all__ = ["allocate", "payload_of", "validate_for", "apply_to", "ensure_rows", "reset"]


def allocate(
    module: nn.Module, *, num_gemms: int, device: torch.device | str | None, history_rows: int
) -> None:
    """Register ``module``'s six metadata buffers: zero histories, scales 1 (non-persistent).

    Raises:
        ConfigError: for a GEMM or row count that is not an int >= 1.
    """
    for name, value in (("num_gemms", num_gemms), ("history_rows", history_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"{type(module).__name__}.init_fp8_meta({name}=...)",
                repr(value),
                "an int >= 1",
                f"Pass a positive {name}.",
            )
    if device is None:  # the module's own device: its first parameter or buffer, else CPU
        first = next(iter([*module.parameters(), *module.buffers()]), None)
        device = first.device if first is not None else torch.device("cpu")
    for d in DIRECTIONS:
        n = num_gemms * slots_per_gemm(d)
        initial = {
            "amax_history": torch.zeros(history_rows, n, dtype=torch.float32, device=device),
            "scale": torch.ones(n, dtype=torch.float32, device=device),
            "scale_inv": torch.ones(n, dtype=torch.float32, device=device),
        }
        for field, tensor in initial.items():
            module.register_buffer(buffer_name(d, field), tensor, persistent=False)


def payload_of(state: FP8State) -> torch.Tensor:
    """The schema payload of a module's live state; a ``meta`` tensor for a module on meta."""
    if state.fwd.scale.device.type == "meta":
        placeholder = FP8State(_zeros_like(state.fwd), _zeros_like(state.bwd), state.recipe)
        return torch.empty_like(pack(placeholder), device="meta")
    return pack(state)


def validate_for(module: FP8Friend, state: Any) -> FP8State:
    """Check ``state`` (ours, or a TransformerEngine value of any era) for ``module``.

    Nothing about the module changes. A TE value holding no FP8 state (FP8 never ran, or a
    stateless recipe) becomes fresh metadata: zero history, scales 1, the module's own rows and
    recipe, since the checkpoint has none to offer.

    Raises:
        SchemaError, SchemaVersionError, LegacyFormatError, UnsafeCheckpointError: with the
        payload key at fault as the error's key.
    """
    num_gemms = module.fp8_num_gemms
    if not is_payload(state):
        # Imported here: fp8state payloads never need the TE decoder (docs/migration.md).
        from fp8state._te.extra_state import decode_te_extra_state
        from fp8state.schema import default_payload

        state = decode_te_extra_state(state, num_gemms=num_gemms)
        if state is None:
            rows = module.fp8_meta("fwd").amax_history.shape[0]
            state = default_payload(num_gemms, rows=rows, recipe=module.fp8_recipe)
    return unpack(_onto(state, module.fp8_meta("fwd").scale.device), num_gemms=num_gemms)


@torch.no_grad()
def apply_to(module: FP8Friend, state: FP8State) -> None:
    """Copy a validated state into ``module``'s buffers, on the module's own device.

    A history with fewer rows than the module's is zero-padded, one with more grows the
    buffers; either way one warning names both lengths. A module still on ``meta`` takes the
    payload's device, as ``load_state_dict(assign=True)`` does for parameters.
    """
    rows_mod = module.fp8_meta("fwd").amax_history.shape[0]
    rows_ck = state.rows
    if rows_ck != rows_mod:
        warnings.warn(
            f"{type(module).__name__}: checkpoint amax history has {rows_ck} rows, the module "
            f"{rows_mod}; {'zero-padding' if rows_ck < rows_mod else 'growing the buffer'} "
            f"to {max(rows_ck, rows_mod)} rows, nothing dropped.",
            stacklevel=5,
        )
    if rows_ck == rows_mod and module.fp8_meta("fwd").scale.device.type != "meta":
        # The common case: every buffer keeps its shape and device. One call for the six
        # (on an H200 host this beat one pinned block per module: the pinned allocation and
        # the concatenation cost more than the five transfers they save).
        torch._foreach_copy_(
            [t for d in DIRECTIONS for t in module.fp8_meta(d)],
            [t for d in DIRECTIONS for t in state.direction(d)],
        )
    else:
        _replace_buffers(module, state)
    if state.recipe != module.fp8_recipe:
        module.fp8_recipe = state.recipe
    module._fp8_reset_steps()


def _replace_buffers(module: FP8Friend, state: FP8State) -> None:
    """Copy ``state`` into buffers as long as the longer history (new ones where needed)."""
    rows_ck = state.rows
    rows_mod = module.fp8_meta("fwd").amax_history.shape[0]
    rows = max(rows_ck, rows_mod)
    for d in DIRECTIONS:
        src = state.direction(d)
        live = module.fp8_meta(d)
        on_meta = live.scale.device.type == "meta"
        materialize = on_meta or rows != rows_mod
        device = src.scale.device if on_meta else live.scale.device
        for field in TENSOR_FIELDS:
            value = getattr(src, field)
            target = getattr(live, field)
            if materialize:
                shape = (rows, value.shape[1]) if field == "amax_history" else value.shape
                target = torch.zeros(shape, dtype=torch.float32, device=device)
                setattr(module, buffer_name(d, field), target)
            if field == "amax_history" and rows_ck < rows:
                target[rows_ck:].zero_()
                target = target[:rows_ck]
            target.copy_(value)


@torch.no_grad()
def ensure_rows(module: FP8Friend, rows: int, stacklevel: int = 2) -> None:
    """Grow ``module``'s history buffers to ``rows`` rows (zeros appended), warning once."""
    current = module.fp8_meta("fwd").amax_history.shape[0]
    if rows <= current:
        return
    warnings.warn(
        f"{type(module).__name__}: amax history grows from {current} to {rows} rows "
        f"(recipe window or checkpoint longer than the buffer); no value is dropped.",
        stacklevel=stacklevel,
    )
    for d in DIRECTIONS:
        old = module.fp8_meta(d).amax_history
        new = old.new_zeros(rows, old.shape[1])
        new[:current] = old
        setattr(module, buffer_name(d, "amax_history"), new)
    bump_buffer_generation()


@torch.no_grad()
def reset(module: FP8Friend) -> None:
    """Give ``module`` a freshly built module's metadata (zero histories, scales 1)."""
    for direction in DIRECTIONS:
        hist, scale, scale_inv = module.fp8_meta(direction)
        hist.zero_()
        scale.fill_(1.0)
        scale_inv.fill_(1.0)
    module._fp8_reset_steps()
    module._fp8_touch()


def _onto(state: Any, device: torch.device) -> Any:
    """``state`` with tensors on a third device moved to ``device`` (untouched for meta).

    Validation computes on the payload's tensors; a payload loaded onto another GPU
    (``map_location="cuda:0"`` for a module on cuda:1) would otherwise allocate its temporaries
    there. CPU tensors stay: validating them allocates nothing on any GPU.
    """
    if device.type == "meta":
        # A meta module takes the payload's own device (apply_to): validate it there.
        return state
    if isinstance(state, torch.Tensor):
        foreign_tensor = not state.is_cpu and not state.is_meta and state.device != device
        return state.to(device) if foreign_tensor else state
    if not isinstance(state, Mapping):
        return state
    target = device
    foreign = [
        k
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and not v.is_cpu and not v.is_meta and v.device != target
    ]
    if not foreign:
        return state
    moved = dict(state)
    for k in foreign:
        moved[k] = state[k].to(target)
    return moved


def _zeros_like(d: DirectionState) -> DirectionState:
    # device="cpu": inside `with torch.device("meta")` the default device is meta.
    return DirectionState(*(torch.zeros(t.shape, device="cpu") for t in d))
