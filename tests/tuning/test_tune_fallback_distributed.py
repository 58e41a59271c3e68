"""``tune_fallback`` on 2 gloo ranks: every rank's sizes, the slowest rank's times, one choice."""

from __future__ import annotations

import time

import pytest
import torch
from dist_workers.launch import init_gloo, run_ranks, shutdown, store_path
from torch import nn

import fp8state
from fp8state.errors import ConfigError

pytestmark = pytest.mark.slow

# Rank 1's sleep while a GEMM runs in FP8: far above what a loaded two-core machine stalls a
# block of steps that exchange amaxes (every candidate does, with two ranks).
H, SLOW_S = 64, 0.1


def _tune(rank: int, out: str, case: str) -> None:
    """``case``: "same" batches, rank 1's "longer", or FP8 on "neither" rank."""
    torch.manual_seed(0)
    model = nn.Sequential(fp8state.Linear(H, H), fp8state.Linear(H, H // 2))
    x = torch.randn(32 if case == "longer" and rank == 1 else 16, H)
    fp8 = case != "neither"
    before = [t.clone() for t in model[0].fp8_meta("fwd")]

    def step() -> None:
        with fp8state.fp8_autocast(enabled=fp8):
            y = model(x)
        # Only rank 1 is slow, and only while a GEMM runs in FP8: alone, rank 0 would pick
        # any threshold (they all cost it about the same).
        if rank == 1 and any(m.fp8_last_gemm_backend != "high_precision" for m in model):
            time.sleep(SLOW_S)
        y.sum().backward()

    try:
        tuning = fp8state.tune_fallback(model, step, steps=2, repeats=3, warmup=1)
    except ConfigError as err:
        after = model[0].fp8_meta("fwd")
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        torch.save({"error": str(err), "unchanged": unchanged}, f"{out}/rank{rank}.pt")
        return
    result = {
        "gemm_macs": list(tuning.gemm_macs),
        "ms": [[k, v] for k, v in sorted(tuning.ms_per_step.items())],
        "chosen": tuning.chosen,
        "set": [m.fp8_min_gemm_macs for m in model],
    }
    torch.save(result, f"{out}/rank{rank}.pt")


def _worker(rank: int, world: int, store: str, out: str, case: str) -> None:
    init_gloo(rank, world, store)
    try:
        _tune(rank, out, case)
    finally:
        shutdown()


def _run(tmp_path, case: str) -> list[dict]:
    args = (2, store_path(str(tmp_path), "tune"), str(tmp_path), case)
    run_ranks(_worker, 2, args, timeout=120)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_every_rank_keeps_the_same_threshold(tmp_path) -> None:
    ranks = _run(tmp_path, "same")
    sizes = [16 * H * (H // 2), 16 * H * H]
    assert ranks[0]["gemm_macs"] == ranks[1]["gemm_macs"] == sizes
    assert ranks[0]["ms"] == ranks[1]["ms"]  # reduced: bit for bit the same numbers
    # Only the all-high-precision candidate spares rank 1 the sleep.
    assert ranks[0]["chosen"] == ranks[1]["chosen"] == sizes[1] + 1
    assert ranks[0]["set"] == ranks[1]["set"] == [sizes[1] + 1] * 2


def test_ranks_whose_gemm_sizes_differ_time_every_rank_s_sizes(tmp_path) -> None:
    # Rank 1's batch is twice rank 0's: between them they run three GEMM sizes.
    ranks = _run(tmp_path, "longer")
    sizes = [16 * H * (H // 2), 16 * H * H, 32 * H * H]
    assert ranks[0]["gemm_macs"] == ranks[1]["gemm_macs"] == sizes
    assert ranks[0]["ms"] == ranks[1]["ms"]
    assert [c for c, _ in ranks[0]["ms"]] == [*sizes, sizes[-1] + 1]
    # Rank 1 runs a GEMM in FP8 at every other candidate, rank 0's sizes included.
    assert ranks[0]["chosen"] == ranks[1]["chosen"] == sizes[-1] + 1
    assert ranks[0]["set"] == ranks[1]["set"] == [sizes[-1] + 1] * 2


def test_ranks_that_ran_no_fp8_gemm_are_refused_alike(tmp_path) -> None:
    for rank in _run(tmp_path, "neither"):
        assert "a step that ran no eager FP8 GEMM" in rank["error"]
        assert rank["unchanged"]
