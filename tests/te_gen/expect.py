"""Checks of a converted payload against a generated module's :class:`~te_gen.payloads.Truth`.

Written from what the conversion must mean, not from how it is done: row ``k`` of our history is
the amax TE recorded ``k`` steps before the checkpoint (zero where TE no longer held it), and TE
v0.1-v0.5's per-GEMM tensors (input, weight | grad_output) sit in our slots 3g, 3g+1 | 2g.
"""

from __future__ import annotations

import torch

from fp8state.schema import as_mapping
from te_gen.history import TEMeta
from te_gen.payloads import Truth

FORMAT_CODES = {"E4M3": 0, "HYBRID": 1}
ALGO_CODES = {"max": 0, "most_recent": 1}


def our_columns(truth: Truth, direction: str) -> list[int]:
    """Our slot of each TE column."""
    g = truth.num_gemms
    if not truth.old_layout:
        return list(range(g * (3 if direction == "fwd" else 2)))
    if direction == "fwd":
        return [3 * i + r for i in range(g) for r in (0, 1)]
    return [2 * i for i in range(g)]


def retained_steps(truth: Truth, steps: int) -> int:
    """How many past steps TE's history still holds: L when rolled at the start of a step,
    L-1 when rolled at the end (the roll zeroes row 0 after moving it to the last row)."""
    return min(steps, truth.rows - (1 if truth.at_end else 0))


def expected_direction(truth: Truth, direction: str) -> dict[str, torch.Tensor]:
    """Our scale, scale_inv and history for one direction."""
    meta: TEMeta = truth.fwd if direction == "fwd" else truth.bwd
    n = truth.num_gemms * (3 if direction == "fwd" else 2)
    cols = torch.tensor(our_columns(truth, direction))
    scale, scale_inv, history = torch.ones(n), torch.ones(n), torch.zeros(truth.rows, n)
    scale[cols] = meta.scale
    scale_inv[cols] = meta.scale_inv
    k = retained_steps(truth, meta.recorded.shape[0])
    history[:k, cols] = meta.recorded[:k]
    return {"scale": scale, "scale_inv": scale_inv, "amax_history": history}


def assert_matches_truth(payload: dict[str, torch.Tensor], truth: Truth) -> None:
    """Bit-exact comparison of a schema payload (any version) with the truth."""
    assert payload is not None
    if isinstance(payload, torch.Tensor):  # schema 2's form; live views are mappings already
        payload = as_mapping(payload)
    for d in ("fwd", "bwd"):
        for field, want in expected_direction(truth, d).items():
            got = payload[f"{d}.{field}"]
            assert got.dtype == torch.float32 and got.device.type == "cpu"
            assert torch.equal(got, want), f"{d}.{field}: {got} != {want}"
    assert int(payload["recipe.fp8_format"]) == FORMAT_CODES[truth.fp8_format]
    assert int(payload["recipe.margin"]) == truth.margin
    assert int(payload["recipe.amax_history_len"]) == truth.rows
    assert int(payload["recipe.amax_compute_algo"]) == ALGO_CODES[truth.algo]
