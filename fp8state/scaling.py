"""Pure tensor functions of delayed scaling: history roll, amax record, amax -> scale.

Nothing here holds state or knows about modules: each function takes tensors and returns new
ones, so the same code serves the mixin, the migration and the tests.

Amax history layout: a float32 tensor ``(rows, n_slots)``; row 0 is the most recent step, row 1
the step before, and so on.

Edge cases of :func:`scale_from_amax`, per slot (``fp8_max`` of the slot's FP8 dtype):

============================  ===============================================================
amax                          new scale
============================  ===============================================================
normal (> 0, finite)          ``fp8_max / amax / 2**margin``
tiny (quotient overflows)     clamped to the largest float32 (``3.4028e38``)
0                             previous scale kept (nothing was recorded in the window)
inf                           previous scale kept
NaN                           previous scale kept
============================  ===============================================================

A scale that would underflow to 0 (absurd margins) is clamped to the smallest normal float32,
so a scale is always finite and > 0, and ``scale_inv = 1 / scale`` always finite.

:func:`record_amax` stores a non-finite amax (an overflowing step) as 0, i.e. "no information":
one bad step neither poisons the whole window (TE keeps an inf in its history for
``amax_history_len`` steps) nor makes the checkpoint invalid.
"""

from __future__ import annotations

import torch

__all__ = [
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "amax_from_history",
    "scale_from_amax",
    "update_scale",
    "shift_history",
    "shift_histories_",
    "record_amax",
]

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)


def amax_from_history(history: torch.Tensor, window: int, algo: str) -> torch.Tensor:
    """Amax per slot that the next scale is computed from.

    Args:
        history: ``(rows, n_slots)`` float32, row 0 most recent.
        window: Number of most recent rows to consider (``DelayedScaling.amax_history_len``).
        algo: ``"max"`` (largest amax in the window) or ``"most_recent"`` (row 0).

    Returns:
        ``(n_slots,)`` float32 tensor on the history's device.

    Example:
        >>> import torch
        >>> from fp8state import scaling
        >>> history = torch.tensor([[2.0, 0.0], [7.0, 0.0], [100.0, 0.0]])  # row 0 newest
        >>> scaling.amax_from_history(history, window=2, algo="max")  # 100 is outside
        tensor([7., 0.])
        >>> scaling.amax_from_history(history, window=2, algo="most_recent")
        tensor([2., 0.])
    """
    if algo == "most_recent":
        return history[0].clone()
    if algo == "max":
        return history[:window].amax(dim=0)
    raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {algo!r}")


def scale_from_amax(
    amax: torch.Tensor, prev_scale: torch.Tensor, fp8_max: float, margin: int
) -> torch.Tensor:
    """New scale per slot: ``fp8_max / amax / 2**margin`` with the edge cases of the table above.

    Args:
        amax: ``(n_slots,)`` float32.
        prev_scale: ``(n_slots,)`` float32, kept where ``amax`` is 0 or not finite.
        fp8_max: Largest value of the slot's FP8 dtype (448 for E4M3, 57344 for E5M2).
        margin: ``DelayedScaling.margin``.

    Returns:
        ``(n_slots,)`` float32, finite and > 0 wherever ``prev_scale`` is.

    Example:
        One slot per row of the edge-case table: normal, 0, inf, tiny.

        >>> import torch
        >>> from fp8state import scaling
        >>> amax = torch.tensor([2.0, 0.0, float("inf"), 1e-38])
        >>> scaling.scale_from_amax(amax, torch.full((4,), 1.5), fp8_max=448.0, margin=1)
        tensor([1.1200e+02, 1.5000e+00, 1.5000e+00, 3.4028e+38])
    """
    # Same operation order as the documented formula, so tests can check it bit for bit. A
    # float divided by a tensor would run reciprocal(amax) * fp8_max (two roundings, one ulp off
    # for about a quarter of amaxes), hence the tensor numerator: one IEEE float32 division.
    scale = torch.full_like(amax, fp8_max) / amax
    # Then divide by 2**margin in power-of-two steps float32 can hold (exact while the result is
    # normal); 2.0**margin itself is inf in float32 from margin 128 and a Python OverflowError from
    # 1024. Past 2**300 every finite quotient is below FLOAT32_TINY, so the cap changes nothing.
    remaining = min(margin, 300)
    while remaining > 0:
        step = min(remaining, 126)
        scale = scale / (2.0**step)
        remaining -= step
    scale = scale.clamp(min=FLOAT32_TINY, max=FLOAT32_MAX)  # inf from tiny amax -> float32 max
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, scale, prev_scale)


def update_scale(
    history: torch.Tensor,
    prev_scale: torch.Tensor,
    *,
    window: int,
    algo: str,
    fp8_max: float,
    margin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and scale_inv per slot from a history, as delayed scaling does at a step's end.

    Args:
        history: ``(rows, n_slots)`` float32, row 0 most recent.
        prev_scale: ``(n_slots,)`` float32, kept where the amax is 0 or not finite.
        window: ``DelayedScaling.amax_history_len``.
        algo: ``DelayedScaling.amax_compute_algo``.
        fp8_max: Largest value of the slots' FP8 dtype (``Format.max(direction)``).
        margin: ``DelayedScaling.margin``.

    Returns:
        ``(scale, scale_inv)``, both ``(n_slots,)`` float32 on the history's device.

    Example:
        >>> import torch
        >>> from fp8state import scaling
        >>> history = torch.tensor([[2.0, 0.0], [7.0, 0.0]])
        >>> scale, scale_inv = scaling.update_scale(
        ...     history, torch.ones(2), window=2, algo="max", fp8_max=448.0, margin=0)
        >>> scale.tolist(), bool((scale_inv == 1 / scale).all())
        ([64.0, 1.0], True)
    """
    scale = scale_from_amax(amax_from_history(history, window, algo), prev_scale, fp8_max, margin)
    return scale, torch.reciprocal(scale)


def shift_history(history: torch.Tensor) -> torch.Tensor:
    """Open a new step: rows move down by one, the oldest falls off, row 0 becomes zeros.

    Example:
        >>> import torch
        >>> from fp8state import scaling
        >>> scaling.shift_history(torch.tensor([[3.0], [2.0], [1.0]])).flatten().tolist()
        [0.0, 3.0, 2.0]
    """
    shifted = torch.zeros_like(history)
    shifted[1:] = history[:-1]
    return shifted


def shift_histories_(histories: list[torch.Tensor]) -> None:
    """:func:`shift_history` of every tensor of ``histories``, in place, a few launches for all.

    Example:
        >>> import torch
        >>> from fp8state import scaling
        >>> a, b = torch.tensor([[3.0], [2.0], [1.0]]), torch.tensor([[5.0, 6.0], [7.0, 8.0]])
        >>> scaling.shift_histories_([a, b])
        >>> a.flatten().tolist(), b.tolist()
        ([0.0, 3.0, 2.0], [[0.0, 0.0], [5.0, 6.0]])
    """
    if not histories:
        return
    moved = torch._foreach_mul([h[:-1] for h in histories], 1.0)  # copies: rows overlap
    torch._foreach_copy_([h[1:] for h in histories], moved)
    torch._foreach_zero_([h[0] for h in histories])


def record_amax(row0: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Combine a new amax with what the current step already recorded (their max).

    Non-finite amaxes count as 0 (see the module docstring).

    Example:
        >>> import torch
        >>> from fp8state import scaling
        >>> row0 = torch.tensor([2.0, 2.0])  # what this step recorded so far
        >>> scaling.record_amax(row0, torch.tensor([5.0, float("nan")])).tolist()
        [5.0, 2.0]
    """
    amax = amax.to(torch.float32)
    clean = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    return torch.maximum(row0, clean)
