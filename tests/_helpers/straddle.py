"""What ranks whose batches straddle a GEMM's FP8 threshold must agree on (gloo and NCCL tests).

The results are those of ``dist_workers.amax_worker`` in mode ``"straddle"``: on rank 0 the
first Linear and the MLP run in FP8, on rank 1 only the MLP, and the head on neither.
"""

from __future__ import annotations

import torch

from _helpers.state import assert_same

HIGH = "high_precision"


def assert_ranks_reduced_alike(results: list[dict], steps: int) -> None:
    """Each rank reduced every module every step, and all hold the same metadata."""
    for step in range(steps):
        first, second = results[0]["backends"][step], results[1]["backends"][step]
        assert first[0] != HIGH and second[0] == HIGH  # the first Linear: FP8 on rank 0 only
        assert HIGH not in (first[1], second[1])  # the MLP: FP8 on both
        assert first[2] == second[2] == HIGH  # the head: FP8 on neither
    # Linear 3 + MLP 6 + head 3 forward slots, 2 + 4 + 2 backward, for each of the four
    # models (eager, compiled with the context around it and inside it, checkpointed:
    # reentrant, its recomputation carries the backward part), each step: one collective per
    # direction, the same size on each rank.
    assert results[0]["sizes"] == results[1]["sizes"] == [12, 8] * 4 * steps
    for r in results:
        for twin in ("compiled", "inside", "checkpointed"):
            assert_same(r[twin], r["eager"])
    assert_same(results[1]["eager"], results[0]["eager"])
    first_linear, head = results[0]["eager"]["0"], results[0]["eager"]["2"]
    for k in range(steps):  # row k is step steps-1-k: only rank 0 recorded the first Linear
        assert first_linear["fwd.amax_history"][k, 0] == results[0]["input_amax"][steps - 1 - k]
        assert first_linear["bwd.amax_history"][k, 0] > 0
    # Ran in FP8 nowhere: zero rows stepped in, the scales stayed 1.
    for direction in ("fwd", "bwd"):
        assert not head[f"{direction}.amax_history"].any()
        scale = head[f"{direction}.scale"]
        assert torch.equal(scale, torch.ones_like(scale))
