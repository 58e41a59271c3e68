"""TE's FP8 metadata as a TE run leaves it, simulated from te_formats.md (sections 2 and 4).

TE's update rolls the history up by one (old row 0 to the last row) and zeroes row 0; amaxes are
recorded into row 0. Up to v1.5 the update runs at the start of the next step (``at_end=False``),
from v1.6 at the end of the step (``at_end=True``). The simulation keeps what was recorded at
every step, so tests can check the converted history against "the amax of k steps ago" without
re-stating the conversion rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = {"E4M3": (448, 448), "HYBRID": (448, 57344)}


@dataclass
class TEMeta:
    """One direction's TE tensors and the amaxes recorded at each step (newest first)."""

    scale: torch.Tensor
    scale_inv: torch.Tensor
    amax_history: torch.Tensor
    recorded: torch.Tensor  # (steps, n): row k = the amax recorded k steps before the last


def _roll(history: torch.Tensor) -> torch.Tensor:
    rolled = torch.roll(history, -1, 0)
    rolled[0] = 0.0
    return rolled


def simulate(
    n: int,
    active: list[bool],
    *,
    rows: int,
    steps: int,
    at_end: bool,
    fp8_max: int,
    margin: int,
    gen: torch.Generator,
    pow2: bool = False,
) -> TEMeta:
    """Run ``steps`` TE steps for ``n`` FP8 tensors; inactive ones never record an amax."""
    mask = torch.tensor(active, dtype=torch.float32)
    history = torch.zeros(rows, n)
    scale = torch.ones(n)
    recorded = []
    for step in range(steps):
        if not at_end and step > 0:
            history = _roll(history)
        amax = (torch.rand(n, generator=gen) * 4 + 0.01) * mask
        history[0] = amax
        recorded.append(amax)
        amax_max = history.amax(dim=0)
        new = fp8_max / amax_max / 2.0**margin
        if pow2:
            new = torch.exp2(torch.floor(torch.log2(new)))
        scale = torch.where(amax_max > 0, new, scale).to(torch.float32)
        if at_end:
            history = _roll(history)
    return TEMeta(scale, torch.reciprocal(scale), history, torch.stack(recorded[::-1]))


def active_slots(num_gemms: int, old: bool, direction: str, quantizes: bool) -> list[bool]:
    """Which of TE's FP8 tensors record amaxes: inputs, weights and grad outputs of GEMMs."""
    per = (2 if direction == "fwd" else 1) if old else (3 if direction == "fwd" else 2)
    used = {0, 1} if direction == "fwd" else {0}
    return [quantizes and (i % per) in used for i in range(num_gemms * per)]
