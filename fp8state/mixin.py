"""FP8StateMixin: owns a module's FP8 scaling metadata and checkpoints it safely.

A module subclasses :class:`FP8StateMixin` and calls ``self.init_fp8_meta(num_gemms=...)`` once
in ``__init__``. The mixin then

1. holds the metadata as non-persistent buffers (``fp8_{fwd,bwd}_{amax_history,scale,
   scale_inv}``), so ``.to()``, ``.cuda()``, ``to_empty()`` and FSDP move them with the module;
2. records amaxes and updates scales with the pure functions of :mod:`fp8state.scaling`;
3. serializes the metadata in ``get_extra_state`` as one CPU float32 tensor
   (:mod:`fp8state.schema`, version 2), so the module's state dict holds tensors only, and
   restores it in ``set_extra_state`` onto the module's own device after validating everything.

Load order: PyTorch's ``_load_from_state_dict`` copies parameters, then calls
``set_extra_state``. The mixin validates the extra state *before* that, so a bad payload raises
(naming the state-dict key) while the module is still untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from fp8state import scaling
from fp8state._runtime import handles, meta_io, recompute, staging
from fp8state._runtime.buffers import ALL_BUFFER_NAMES, BUFFER_NAMES
from fp8state._runtime.friend import CachedWeight, StepBookkeeping
from fp8state._runtime.generation import bump_buffer_generation
from fp8state._runtime.scale_update import update_direction_
from fp8state.errors import ConfigError, FP8StateError
from fp8state.recipe import DEFAULT_HISTORY_ROWS, DelayedScaling
from fp8state.schema import DIRECTIONS, EXTRA_STATE_KEY, DirectionState, FP8State
from fp8state.slots import Direction, by_direction

__all__ = ["FP8StateMixin", "ScalingBuffers", "DEFAULT_HISTORY_ROWS"]

#: What :meth:`FP8StateMixin.fp8_meta` returns: the live buffers of one direction (the
#: module's own tensors, not copies), as the schema's :class:`~fp8state.schema.DirectionState`.
ScalingBuffers = DirectionState


class FP8StateMixin(StepBookkeeping, nn.Module):
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
        >>> sorted(fp8state.schema.as_mapping(m.get_extra_state()))[:3]
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
    #: fp8_autocast. None: the backend's default (``fp8state.backends.DEFAULT_MIN_GEMM_MACS``,
    #: or ``GRAPHED_MIN_GEMM_MACS`` where ``fp8_graphed``); 0: always FP8.
    fp8_min_gemm_macs: int | None = None
    #: Set by ``fp8state.make_graphed_callables``: the module's steps replay as CUDA graphs, so
    #: the host's launch cost no longer counts against FP8 in the default threshold.
    fp8_graphed: bool = False

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
                type(self).__name__,
                "a second init_fp8_meta() call",
                "exactly one call",
                "Call init_fp8_meta once, in __init__.",
            )
        meta_io.allocate(self, num_gemms=num_gemms, device=device, history_rows=history_rows)
        self._fp8_num_gemms = num_gemms
        self._fp8_mutations = 0  # see StepBookkeeping
        self._fp8_join_runtime()
        self._fp8_new_step: dict[Direction, bool] = {d: True for d in DIRECTIONS}
        #: FP8 copies of weights kept across micro-batches (``is_first_microbatch``), per GEMM.
        self.fp8_weight_cache: dict[int, CachedWeight] = {}
        self.fp8_recipe = recipe or DelayedScaling(
            amax_history_len=min(DEFAULT_HISTORY_ROWS, history_rows)
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling and ``copy.deepcopy`` make a new module without ``__init__``.

        It joins the runtime as a new one does (:meth:`_fp8_join_runtime`).
        """
        super().__setstate__(state)
        if self._fp8_num_gemms is not None:
            self._fp8_join_runtime()

    def _fp8_join_runtime(self) -> None:
        """A module born (``init_fp8_meta``) or reborn without ``__init__`` joins the runtime.

        It may reuse a dead module's ``id()``: pointer tables keyed by ids are rebuilt
        (``_runtime.generation``), and it gets its own staging entry and compiled-graph handle.
        """
        bump_buffer_generation()
        staging.register(self)
        handles.register(self)

    # ------------------------------------------------------------------ metadata access
    @property
    def fp8_recipe(self) -> DelayedScaling:
        """The recipe of the module's last FP8 step (or load); saved in checkpoints."""
        return self._fp8_recipe

    @fp8_recipe.setter
    def fp8_recipe(self, recipe: DelayedScaling) -> None:
        if not isinstance(recipe, DelayedScaling):
            raise ConfigError(
                f"{type(self).__name__}.fp8_recipe",
                type(recipe).__name__,
                "an fp8state.DelayedScaling",
                "Assign a DelayedScaling recipe.",
            )
        # A window longer than the buffer would make get_extra_state() write a payload that
        # set_extra_state() refuses (window > rows): grow now, with the one warning.
        self._fp8_ensure_rows(recipe.amax_history_len)
        if recipe != self.__dict__.get("_fp8_recipe"):
            # Cached update tables assume the recipes their modules had when built.
            bump_buffer_generation()
        self._fp8_recipe = recipe

    @property
    def fp8_num_gemms(self) -> int:
        """Number of GEMMs declared in ``init_fp8_meta``."""
        return self._require_meta()

    def fp8_meta(self, direction: Direction) -> DirectionState:
        """The live buffers of ``direction`` (``"fwd"`` or ``"bwd"``)."""
        self._require_meta()
        names = BUFFER_NAMES.get(direction)
        if names is None:
            names = by_direction(direction, (), ())  # raises: names the unknown direction
        # _buffers directly: nn.Module.__getattr__ is slow, and this runs several times a step.
        buffers = self._buffers
        hist, scale, scale_inv = (cast(torch.Tensor, buffers[n]) for n in names)
        return DirectionState(hist, scale, scale_inv)

    def fp8_state(self) -> FP8State:
        """The module's metadata and recipe as an :class:`~fp8state.schema.FP8State` (live)."""
        fwd, bwd = (DirectionState(*self.fp8_meta(d)) for d in DIRECTIONS)
        return FP8State(fwd, bwd, self.fp8_recipe)

    def _require_meta(self) -> int:
        if self._fp8_num_gemms is None:
            raise ConfigError(
                type(self).__name__,
                "no FP8 metadata",
                "init_fp8_meta() called in __init__",
                "Call self.init_fp8_meta(num_gemms=...) in the module's __init__.",
            )
        return self._fp8_num_gemms

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """Move the FP8 buffers with the module, but keep them float32.

        ``.half()`` and ``.to(torch.bfloat16)`` convert every floating-point buffer; FP8
        metadata must stay float32 (the schema requires it, and a bf16 scale is not the scale
        that was computed). Device moves (``.to(device)``, ``.cuda()``, ``to_empty()``) apply.
        """
        before = {name: self._buffers.get(name) for name in ALL_BUFFER_NAMES}
        result = super()._apply(fn, recurse)
        bump_buffer_generation()
        # Cached FP8 weights stay where they were cast: a move would leave them on the old
        # device (a device mismatch at the next is_first_microbatch=False forward).
        cache = self.__dict__.get("fp8_weight_cache")  # absent before init_fp8_meta()
        if cache:
            cache.clear()
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        if any(
            old is not None and old.is_meta and not cast(torch.Tensor, self._buffers[n]).is_meta
            for n, old in before.items()
        ):
            # Materialized from meta (to_empty): the buffers hold whatever memory they got.
            # Metadata has no values on meta; the only right content is a fresh module's.
            meta_io.reset(self)
        return result

    def fp8_reset_meta(self) -> None:
        """Forget every recorded amax: zero histories, scales 1, as a freshly built module.

        The recipe and the buffers' shapes and devices stay. ``to_empty()`` from the meta
        device does this by itself; :func:`fp8state.recalibrate` also refills from data.

        Example:
            >>> import torch, fp8state
            >>> layer = fp8state.Linear(16, 16)
            >>> with fp8state.fp8_autocast():
            ...     _ = layer(torch.randn(4, 16))
            >>> layer.fp8_reset_meta()
            >>> hist, scale, _ = layer.fp8_meta("fwd")
            >>> float(hist.abs().sum()), float(scale[0])
            (0.0, 1.0)
        """
        self._require_meta()
        meta_io.reset(self)

    # ------------------------------------------------------------------ delayed scaling
    @torch.no_grad()
    def fp8_record_amax(self, direction: Direction, slot: int, amax: torch.Tensor) -> None:
        """Record ``amax`` for ``slot`` of the current step.

        The first record after a scale update shifts the history down one row (a new step);
        later records in the same step keep the max in row 0 (micro-batches, recomputation).
        """
        cell = self.fp8_amax_cell(direction, slot)
        cell.copy_(scaling.record_amax(cell, amax))

    @torch.no_grad()
    def fp8_amax_cell(self, direction: Direction, slot: int) -> torch.Tensor:
        """The 1-element history cell where ``slot`` records this step's amax (row 0).

        Opens a new step first if the last scale update closed one (the history shifts down),
        so a kernel can max-combine its amax straight into the returned view.
        """
        if direction == "fwd":  # a recomputation replays fp8state's calls without this
            recompute.refuse_forward_record(self)
        hist = self.fp8_meta(direction).amax_history
        self._fp8_touch()  # a kernel may write the cell without bumping its _version
        if self._fp8_new_step[direction]:
            hist.copy_(scaling.shift_history(hist))
            self._fp8_new_step[direction] = False
        return hist[0, slot : slot + 1]

    def fp8_open_record(self, direction: Direction) -> bool:
        """Note a record into ``direction``'s row 0; True if it must open a new step first.

        For kernels that shift the history and record in one launch
        (:func:`fp8state._runtime.slot_cast.cast_slot`); :meth:`fp8_amax_cell` does the shift
        itself.
        """
        self._fp8_touch()  # a kernel writes the history without bumping _version
        new_step = self._fp8_new_step
        if new_step[direction]:
            new_step[direction] = False
            return True
        return False

    @torch.no_grad()
    def fp8_update_scales(self, direction: Direction, recipe: DelayedScaling | None = None) -> None:
        """Recompute ``direction``'s scales from its history (the end of a step).

        Args:
            direction: ``"fwd"`` or ``"bwd"``.
            recipe: The recipe the step ran under; it becomes the module's ``fp8_recipe``.
        """
        recipe = recipe or self._fp8_recipe
        if recipe is not self._fp8_recipe:
            self.fp8_recipe = recipe  # grows the buffers first if the window needs more rows
        update_direction_(self.fp8_meta(direction), recipe, direction)
        self._fp8_close_step(direction)

    def _fp8_ensure_rows(self, rows: int) -> None:
        """Grow the history buffers to ``rows`` rows (zeros appended), warning once."""
        # 6: past meta_io, this method, the property setter and nn.Module.__setattr__ (two
        # frames), to the assignment in the caller's code.
        meta_io.ensure_rows(self, rows, stacklevel=6)

    # ------------------------------------------------------------------ checkpointing
    def get_extra_state(self) -> torch.Tensor:
        """Return the metadata as a schema payload: one CPU float32 tensor (``docs/schema.md``).

        One device-to-host transfer at most and no device-wide synchronize. A module on
        ``meta`` returns a ``meta`` tensor of the same shape (there is no data to save).
        """
        self._require_meta()  # a clear error for a subclass that never called init_fp8_meta
        # model.state_dict() asks every module in turn: the first request stages them all with
        # one transfer, the others take their payload (see fp8state._runtime.staging).
        payload = staging.take(self)
        if payload is not None:
            return payload
        device = self.fp8_meta("fwd").scale.device
        if device.type != "meta":
            staging.stage(device)
            payload = staging.take(self)
            if payload is not None:
                return payload
        return meta_io.payload_of(self.fp8_state())

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
                raise err.under(f"{type(self).__name__}.{EXTRA_STATE_KEY}") from None
        self._fp8_apply(validated)

    def _fp8_validate(self, state: Any) -> FP8State:
        """Validate ``state`` for this module without changing it (see meta_io.validate_for)."""
        return meta_io.validate_for(self, state)

    def _fp8_apply(self, state: FP8State) -> None:
        meta_io.apply_to(self, state)
        self._fp8_touch()
        bump_buffer_generation()

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
        key = prefix + EXTRA_STATE_KEY
        if key in state_dict:
            try:
                validated = self._fp8_validate(state_dict[key])
            except FP8StateError as err:
                raise err.under(key) from None
            self._fp8_pending_load = (state_dict[key], validated)
        try:
            super()._load_from_state_dict(
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
        finally:
            self._fp8_pending_load = None

    def _fp8_has_meta(self) -> bool:
        """Part of the friend interface (fp8state._runtime.friend): init_fp8_meta ran."""
        return self._fp8_num_gemms is not None
