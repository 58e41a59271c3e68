"""What one FP8 GEMM call keeps so that its recomputation can replay it exactly.

A :class:`ForwardRecord` holds the decisions and inputs of a forward call that the module's
live state no longer shows by the time ``torch.utils.checkpoint`` runs the call again during
backward: the ``fp8_autocast`` context in force (None outside any), the GEMM backend chosen
(None: high precision), the forward scales the call cast with, and the cached FP8 weights it
reused (``is_first_microbatch=False``). :mod:`fp8state._runtime.recompute` says when records
are kept and how a recomputation finds its own.
"""

from __future__ import annotations

import weakref

import torch

from fp8state._runtime.friend import CachedWeight
from fp8state.errors import RecomputationError

__all__ = ["ForwardRecord", "ForwardScales", "MLP_SITE", "HIGH_PRECISION", "site_name"]

#: The site of the fused LayerNormMLP call; per-GEMM calls use their GEMM index.
MLP_SITE = -1


class _Held:
    """A strong reference with ``weakref.ref``'s call: ``held()`` is the tensor."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __call__(self) -> torch.Tensor:
        return self.tensor


_Ref = weakref.ref[torch.Tensor] | _Held


def site_name(module: object, site: int) -> str:
    """The module and call an error is about: ``"Linear (GEMM 0)"``."""
    call = "fused GELU MLP" if site == MLP_SITE else f"GEMM {site}"
    return f"{type(module).__name__} ({call})"


class ForwardScales:
    """A copy of a module's forward scales, shared by its calls until the scales change."""

    __slots__ = ("scale", "scale_inv", "_scratch", "_cached", "__weakref__")

    def __init__(self, scale: torch.Tensor, scale_inv: torch.Tensor) -> None:
        self.scale = scale.clone()
        self.scale_inv = scale_inv.clone()
        self._scratch: torch.Tensor | None = None
        # Per GEMM, the FP8 weight a call cast with these scales and cached for later
        # micro-batches (is_first_microbatch=True).
        self._cached: dict[int, weakref.ref[torch.Tensor]] = {}

    def note_cached(self, gemm: int, weight_fp8: torch.Tensor) -> None:
        """A call cast ``weight_fp8`` with these scales and put it in the weight cache."""
        self._cached[gemm] = weakref.ref(weight_fp8)

    def cast_here(self, gemm: int, weight_fp8: torch.Tensor) -> bool:
        """Whether ``weight_fp8`` is GEMM ``gemm``'s weight as cast with these scales."""
        ref = self._cached.get(gemm)
        return ref is not None and ref() is weight_fp8

    def scratch(self) -> torch.Tensor:
        """A ``(1, slots)`` history that a replayed cast records into and nobody reads.

        The casts (and the CUDA kernel) always record an amax; a replay must not touch the
        module's history, whose row 0 may already belong to the next step.
        """
        if self._scratch is None:
            self._scratch = torch.zeros(
                1, self.scale.numel(), dtype=torch.float32, device=self.scale.device
            )
        return self._scratch


class ForwardRecord:
    """One forward call of an FP8 module's GEMM (or fused MLP), as its replay needs it.

    Attributes:
        ctx: The ``fp8_autocast`` context the call ran under (an ``FP8Context``), or None.
        backend: The FP8 GEMM backend it used, or None where it computed in high precision.
        scales: The forward scales it cast with (None when it cast nothing).
    """

    __slots__ = (
        "ctx",
        "backend",
        "scales",
        "_hold",
        "_weights",
        "grad_pending",
        "taken",
        "__weakref__",
    )

    def __init__(
        self,
        ctx: object | None,
        backend: str | None,
        scales: ForwardScales | None,
        *,
        hold_weights: bool = False,
    ) -> None:
        self.ctx = ctx
        self.backend = backend
        self.scales = scales
        self._hold = hold_weights
        self._weights: dict[int, tuple[_Ref | None, ...]] | None = None
        #: Kept for a non-reentrant checkpoint: goes to its module's log once anchored.
        self.grad_pending = False
        #: Replayed; a record kept in both pools of a log leaves the other one then.
        self.taken = False

    def cache_weight(self, gemm: int, weight_fp8: torch.Tensor) -> None:
        """Note that the call cast GEMM ``gemm``'s weight and cached it."""
        if self.scales is not None:
            self.scales.note_cached(gemm, weight_fp8)

    def reuse_weight(self, gemm: int, cached: CachedWeight, transpose: bool) -> None:
        """Note that the call multiplied with ``module.fp8_weight_cache[gemm]``.

        Weakly, unless the record was made with ``hold_weights`` (a drop-in checkpoint's, which
        lives as long as the checkpoint's graph): the cache owns the FP8 weight, and a record
        left in a log must not keep a replaced one alive (a whole model's FP8 weights per
        step); a replay finding it gone raises. A weight cast
        with the call's own scales is not noted: the replay casts it again, to the same bits,
        so that the call replays as the one that cached it (micro-batches of one step in one
        fp8_autocast are then one forward state, and pool matching need not tell them apart),
        provided that cast returns what the call used (a transpose exactly where it had one).
        """
        recast = self.scales is not None and self.scales.cast_here(gemm, cached[0])
        if recast and transpose == (cached[1] is not None):
            return
        if self._weights is None:
            self._weights = {}
        ref = _Held if self._hold else weakref.ref
        self._weights[gemm] = tuple(None if t is None else ref(t) for t in cached)

    def cached_weight(self, module: object, gemm: int) -> CachedWeight | None:
        """The cached FP8 weight the call reused, or None where it cast the weight itself.

        Raises:
            RecomputationError: the cache entry was replaced or cleared since the forward.
        """
        refs = self._weights.get(gemm) if self._weights is not None else None
        if refs is None:
            return None
        weight, weight_t, scale_inv = (None if r is None else r() for r in refs)
        if weight is None or scale_inv is None or (refs[1] is not None and weight_t is None):
            raise RecomputationError(
                site_name(module, gemm),
                "the cached FP8 weight of the forward (is_first_microbatch=False) was replaced "
                "or cleared before its recomputation",
                "the cache entry the forward used, until the backward",
                "Run the backward before the next is_first_microbatch=True forward of the "
                "module, and do not move or load it in between.",
            )
        return weight, weight_t, scale_inv

    def _weight_ids(self) -> tuple[tuple[int, int], ...]:
        if not self._weights:
            return ()
        return tuple(
            sorted((g, id(r[0]()) if r[0] is not None else 0) for g, r in self._weights.items())
        )

    def same_replay(self, other: ForwardRecord) -> bool:
        """Whether replaying ``other`` computes exactly what replaying this record computes."""
        if self.backend is None or other.backend is None:
            return self.backend is other.backend  # both high precision: nothing else matters
        return (
            self.backend == other.backend
            and self.scales is other.scales
            and self.ctx == other.ctx
            and self._weight_ids() == other._weight_ids()
        )


#: What a recomputation replays for a module that never ran under fp8_autocast: the forward
#: computed in high precision, so the replay does too.
HIGH_PRECISION = ForwardRecord(None, None, None)
