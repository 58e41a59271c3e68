"""FP8StateMixin: owns a module's FP8 scaling metadata and checkpoints it safely.

A module subclasses :class:`FP8StateMixin` and calls ``self.init_fp8_meta(num_gemms=...)`` once
in ``__init__``. The mixin then

1. holds the metadata as non-persistent buffers (``fp8_{fwd,bwd}_{amax_history,scale,
   scale_inv}``), so ``.to()``, ``.cuda()``, ``to_empty()`` and FSDP move them with the module;
2. records amaxes and updates scales with the pure functions of :mod:`fp8state.scaling`;
3. serializes the metadata in ``get_extra_state`` as a flat dict of CPU tensors
   (:mod:`fp8state.schema`), and restores it in ``set_extra_state`` onto the module's own device
   after validating everything.

Load order: PyTorch's ``_load_from_state_dict`` copies parameters, then calls
``set_extra_state``. The mixin validates the extra state *before* that, so a bad payload raises
(naming the state-dict key) while the module is still untouched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from fp8state import scaling
from fp8state.errors import ConfigError, FP8StateError
from fp8state.recipe import DelayedScaling
from fp8state.schema import DIRECTIONS, DirectionState, FP8State, pack, slots_per_gemm, unpack

__all__ = ["FP8StateMixin", "ScalingBuffers", "DEFAULT_HISTORY_ROWS"]

#: Rows of the amax history buffers unless a module asks for others (TE's default length).
DEFAULT_HISTORY_ROWS = 1024

_EXTRA_STATE_KEY = "_extra_state"


class ScalingBuffers(NamedTuple):
    """The live buffers of one direction (views into the module, not copies)."""

    amax_history: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor


def _buffer_name(direction: str, field: str) -> str:
    return f"fp8_{direction}_{field}"


class FP8StateMixin(nn.Module):
    """Base class of modules that own FP8 scaling metadata.

    Example:
        A module with two GEMMs (the full version is ``examples/custom_module.py``):

        >>> import torch, fp8state
        >>> class TwoGemms(fp8state.FP8StateMixin):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w1 = torch.nn.Parameter(torch.randn(8, 8))
        ...         self.w2 = torch.nn.Parameter(torch.randn(8, 8))
        ...         self.init_fp8_meta(num_gemms=2)
        >>> m = TwoGemms()
        >>> sorted(m.get_extra_state())[:3]
        ['bwd.amax_history', 'bwd.scale', 'bwd.scale_inv']
        >>> m.fp8_meta("fwd").scale.shape
        torch.Size([6])
    """

    # Class-level defaults so a subclass that forgets init_fp8_meta gets a clear error.
    _fp8_num_gemms: int | None = None
    _fp8_pending_load: tuple[object, FP8State] | None = None
    #: Backend of the module's last GEMM under fp8_autocast: "scaled_mm", "emulated", or
    #: "high_precision" (too small for FP8 to pay, see ``fp8_min_gemm_macs``); "none" before any.
    fp8_last_gemm_backend: str = "none"
    #: GEMMs with fewer multiply-accumulates (tokens * in * out) run in high precision under
    #: fp8_autocast. None: the backend's default (``fp8state.backends.DEFAULT_MIN_GEMM_MACS``);
    #: 0: always FP8.
    fp8_min_gemm_macs: int | None = None

    def init_fp8_meta(
        self,
        *,
        num_gemms: int,
        device: torch.device | str | None = None,
        history_rows: int = DEFAULT_HISTORY_ROWS,
        recipe: DelayedScaling | None = None,
    ) -> None:
        """Allocate the FP8 metadata. Call once, from the subclass's ``__init__``.

        Args:
            num_gemms: GEMMs of the module; it gets ``3 * num_gemms`` forward and
                ``2 * num_gemms`` backward slots, numbered as in TE (:mod:`fp8state.slots`).
            device: Where the buffers live. Default: the device of the module's first
                parameter or buffer, else CPU (a module built on ``meta`` stays on ``meta``).
            history_rows: Rows of the amax history buffers; a recipe's ``amax_history_len`` is a
                window over them.
            recipe: Recipe recorded in checkpoints until the module runs under another one.
                Default: :class:`DelayedScaling` with a window of ``min(1024, history_rows)``.

        Raises:
            ConfigError: for a GEMM or row count < 1, or a second call.
        """
        if self._fp8_num_gemms is not None:
            raise ConfigError(
                type(self).__name__, "a second init_fp8_meta() call", "exactly one call",
                "Call init_fp8_meta once, in __init__.",
            )
        for name, value in (("num_gemms", num_gemms), ("history_rows", history_rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"{type(self).__name__}.init_fp8_meta({name}=...)", repr(value),
                    "an int >= 1", f"Pass a positive {name}.",
                )
        if device is None:
            first = next(iter([*self.parameters(), *self.buffers()]), None)
            device = first.device if first is not None else torch.device("cpu")
        for d in DIRECTIONS:
            n = num_gemms * slots_per_gemm(d)
            initial = {
                "amax_history": torch.zeros(history_rows, n, dtype=torch.float32, device=device),
                "scale": torch.ones(n, dtype=torch.float32, device=device),
                "scale_inv": torch.ones(n, dtype=torch.float32, device=device),
            }
            for field, tensor in initial.items():
                self.register_buffer(_buffer_name(d, field), tensor, persistent=False)
        self._fp8_num_gemms = num_gemms
        # True when the next recorded amax opens a new step (shifts the history down).
        self._fp8_new_step = {d: True for d in DIRECTIONS}
        #: FP8 copies of weights kept across micro-batches (``is_first_microbatch``), per GEMM.
        self.fp8_weight_cache: dict[
            int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]
        ] = {}
        self.fp8_recipe = recipe or DelayedScaling(
            amax_history_len=min(DEFAULT_HISTORY_ROWS, history_rows)
        )

    # ------------------------------------------------------------------ metadata access
    @property
    def fp8_recipe(self) -> DelayedScaling:
        """The recipe of the module's last FP8 step (or load); saved in checkpoints."""
        return self._fp8_recipe

    @fp8_recipe.setter
    def fp8_recipe(self, recipe: DelayedScaling) -> None:
        if not isinstance(recipe, DelayedScaling):
            raise ConfigError(
                f"{type(self).__name__}.fp8_recipe", type(recipe).__name__,
                "an fp8state.DelayedScaling", "Assign a DelayedScaling recipe.",
            )
        # A window longer than the buffer would make get_extra_state() write a payload that
        # set_extra_state() refuses (window > rows): grow now, with the one warning.
        self._fp8_ensure_rows(recipe.amax_history_len)
        self._fp8_recipe = recipe

    @property
    def fp8_num_gemms(self) -> int:
        """Number of GEMMs declared in ``init_fp8_meta``."""
        return self._require_meta()

    def fp8_meta(self, direction: str) -> ScalingBuffers:
        """The live buffers of ``direction`` (``"fwd"`` or ``"bwd"``)."""
        self._require_meta()
        return ScalingBuffers(
            *(getattr(self, _buffer_name(direction, f)) for f in ScalingBuffers._fields)
        )

    def fp8_state(self) -> FP8State:
        """The module's metadata and recipe as an :class:`~fp8state.schema.FP8State` (live)."""
        fwd, bwd = (DirectionState(*self.fp8_meta(d)) for d in DIRECTIONS)
        return FP8State(fwd, bwd, self.fp8_recipe)

    def _require_meta(self) -> int:
        if self._fp8_num_gemms is None:
            raise ConfigError(
                type(self).__name__, "no FP8 metadata", "init_fp8_meta() called in __init__",
                "Call self.init_fp8_meta(num_gemms=...) in the module's __init__.",
            )
        return self._fp8_num_gemms

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """Move the FP8 buffers with the module, but keep them float32.

        ``.half()`` and ``.to(torch.bfloat16)`` convert every floating-point buffer; FP8
        metadata must stay float32 (the schema requires it, and a bf16 scale is not the scale
        that was computed). Device moves (``.to(device)``, ``.cuda()``, ``to_empty()``) apply.
        """
        names = [_buffer_name(d, f) for d in DIRECTIONS for f in ScalingBuffers._fields]
        before = {name: self._buffers.get(name) for name in names}
        result = super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        return result

    # ------------------------------------------------------------------ delayed scaling
    @torch.no_grad()
    def fp8_record_amax(self, direction: str, slot: int, amax: torch.Tensor) -> None:
        """Record ``amax`` for ``slot`` of the current step.

        The first record after a scale update shifts the history down one row (a new step);
        later records in the same step keep the max in row 0 (micro-batches, recomputation).
        """
        cell = self.fp8_amax_cell(direction, slot)
        cell.copy_(scaling.record_amax(cell, amax))

    @torch.no_grad()
    def fp8_amax_cell(self, direction: str, slot: int) -> torch.Tensor:
        """The 1-element history cell where ``slot`` records this step's amax (row 0).

        Opens a new step first if the last scale update closed one (the history shifts down),
        so a kernel can max-combine its amax straight into the returned view.
        """
        hist = self.fp8_meta(direction).amax_history
        if self._fp8_new_step[direction]:
            hist.copy_(scaling.shift_history(hist))
            self._fp8_new_step[direction] = False
        return hist[0, slot : slot + 1]

    @torch.no_grad()
    def fp8_update_scales(self, direction: str, recipe: DelayedScaling | None = None) -> None:
        """Recompute ``direction``'s scales from its history (the end of a step).

        Args:
            direction: ``"fwd"`` or ``"bwd"``.
            recipe: The recipe the step ran under; it becomes the module's ``fp8_recipe``.
        """
        recipe = recipe or self.fp8_recipe
        self.fp8_recipe = recipe  # grows the buffers first if the window needs more rows
        meta = self.fp8_meta(direction)
        scale, scale_inv = scaling.update_scale(
            meta.amax_history, meta.scale,
            window=recipe.amax_history_len, algo=recipe.amax_compute_algo,
            fp8_max=recipe.fp8_format.max(direction), margin=recipe.margin,
        )
        meta.scale.copy_(scale)
        meta.scale_inv.copy_(scale_inv)
        self._fp8_new_step[direction] = True

    def _fp8_ensure_rows(self, rows: int) -> None:
        """Grow the history buffers to ``rows`` rows (zeros appended), warning once."""
        current = self.fp8_meta("fwd").amax_history.shape[0]
        if rows <= current:
            return
        warnings.warn(
            f"{type(self).__name__}: amax history grows from {current} to {rows} rows "
            f"(recipe window or checkpoint longer than the buffer); no value is dropped.",
            stacklevel=3,
        )
        for d in DIRECTIONS:
            old = self.fp8_meta(d).amax_history
            new = old.new_zeros(rows, old.shape[1])
            new[:current] = old
            setattr(self, _buffer_name(d, "amax_history"), new)

    # ------------------------------------------------------------------ checkpointing
    def get_extra_state(self) -> dict[str, torch.Tensor]:
        """Return the metadata as a schema payload of CPU tensors (see ``docs/schema.md``).

        One device-to-host transfer at most and no device-wide synchronize. A module on
        ``meta`` returns ``meta`` tensors of the same shapes (there is no data to save).
        """
        state = self.fp8_state()
        if state.fwd.scale.device.type == "meta":
            return {k: torch.empty_like(v, device="meta") for k, v in pack(
                _as_cpu_placeholder(state)).items()}
        return pack(state)

    def set_extra_state(self, state: Any) -> None:
        """Validate ``state`` fully, then copy it onto the module's own device.

        A history with another number of rows than the module's is zero-padded (fewer rows) or
        grows the buffers (more rows), with one warning. A module still on ``meta`` takes the
        payload's tensors' device, as ``load_state_dict(assign=True)`` does for parameters.

        Raises:
            SchemaError: the payload is invalid; the module is unchanged.
            SchemaVersionError: the payload's schema version is unknown or too new.
        """
        pending = self._fp8_pending_load
        if pending is not None and pending[0] is state:
            validated = pending[1]  # validated by _load_from_state_dict a moment ago
        else:
            try:
                validated = self._fp8_validate(state)
            except FP8StateError as err:
                raise err.under(f"{type(self).__name__}.{_EXTRA_STATE_KEY}") from None
        self._fp8_apply(validated)

    def _fp8_validate(self, state: Any) -> FP8State:
        num_gemms = self._require_meta()
        if not (isinstance(state, Mapping) and "schema_version" in state):
            # A TransformerEngine value of any era: decoded without TE and without running
            # pickled code (docs/migration.md). Imported here: fp8state payloads never need it.
            from fp8state.migrate import decode_te_extra_state
            from fp8state.schema import default_payload

            state = decode_te_extra_state(state, num_gemms=num_gemms)
            if state is None:
                # TE saved no FP8 state (FP8 never ran, or a stateless recipe): load fresh
                # metadata (zero history, scales 1) and keep the module's recipe and rows.
                rows = self.fp8_meta("fwd").amax_history.shape[0]
                state = default_payload(num_gemms, rows=rows, recipe=self.fp8_recipe)
        return unpack(_onto(state, self.fp8_meta("fwd").scale.device), num_gemms=num_gemms)

    @torch.no_grad()
    def _fp8_apply(self, state: FP8State) -> None:
        rows_mod = self.fp8_meta("fwd").amax_history.shape[0]
        rows_ck = state.rows
        if rows_ck != rows_mod:
            warnings.warn(
                f"{type(self).__name__}: checkpoint amax history has {rows_ck} rows, the module "
                f"{rows_mod}; {'zero-padding' if rows_ck < rows_mod else 'growing the buffer'} "
                f"to {max(rows_ck, rows_mod)} rows, nothing dropped.",
                stacklevel=3,
            )
        rows = max(rows_ck, rows_mod)
        for d in DIRECTIONS:
            src = state.direction(d)
            live = self.fp8_meta(d)
            materialize = live.scale.device.type == "meta" or rows != rows_mod
            device = src.scale.device if live.scale.device.type == "meta" else live.scale.device
            for field in ScalingBuffers._fields:
                value = getattr(src, field)
                target = getattr(live, field)
                if materialize:
                    shape = (rows, value.shape[1]) if field == "amax_history" else value.shape
                    target = torch.zeros(shape, dtype=torch.float32, device=device)
                    setattr(self, _buffer_name(d, field), target)
                if field == "amax_history" and rows_ck < rows:
                    target[rows_ck:].zero_()
                    target = target[:rows_ck]
                target.copy_(value)
        self.fp8_recipe = state.recipe
        self._fp8_new_step = {d: True for d in DIRECTIONS}
        self.fp8_weight_cache.clear()  # FP8 weights were cast with the old scales

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + _EXTRA_STATE_KEY
        if key in state_dict:
            try:
                validated = self._fp8_validate(state_dict[key])
            except FP8StateError as err:
                raise err.under(key) from None
            self._fp8_pending_load = (state_dict[key], validated)
        try:
            super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                error_msgs,
            )
        finally:
            self._fp8_pending_load = None


def _onto(state: Any, device: torch.device) -> Any:
    """``state`` with tensors on a third device moved to ``device`` (CPU for a meta module).

    Validation computes on the payload's tensors; a payload loaded onto another GPU
    (``map_location="cuda:0"`` for a module on cuda:1) would otherwise allocate its temporaries
    there. CPU tensors stay: validating them allocates nothing on any GPU.
    """
    if not isinstance(state, Mapping):
        return state
    target = torch.device("cpu") if device.type == "meta" else device
    foreign = [
        k for k, v in state.items()
        if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta")
        and v.device != target
    ]
    if not foreign:
        return state
    moved = dict(state)
    for k in foreign:
        moved[k] = state[k].to(target)
    return moved


def _as_cpu_placeholder(state: FP8State) -> FP8State:
    """Zeros on CPU shaped like ``state`` (for the shapes of a meta module's payload)."""

    def empty(d: DirectionState) -> DirectionState:
        # device="cpu": inside `with torch.device("meta")` the default device is meta.
        return DirectionState(*(torch.zeros(t.shape, device="cpu")
                                for t in (d.amax_history, d.scale, d.scale_inv)))

    return FP8State(empty(state.fwd), empty(state.bwd), state.recipe)
