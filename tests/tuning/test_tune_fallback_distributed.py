"""``tune_fallback`` on 2 gloo ranks: the slowest rank's times, one choice, equal sizes required."""

from __future__ import annotations

import time

import pytest
import torch
from dist_workers.launch import init_gloo, run_ranks, shutdown, store_path
from torch import nn

import fp8state
from fp8state.errors import ConfigError

pytestmark = pytest.mark.slow

H, SLOW_S = 64, 0.03


def _tune(rank: int, out: str, tokens_differ: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(fp8state.Linear(H, H), fp8state.Linear(H, H // 2))
    x = torch.randn(16 * (rank + 1) if tokens_differ else 16, H)
    before = [t.clone() for t in model[0].fp8_meta("fwd")]

    def step() -> None:
        with fp8state.fp8_autocast():
            y = model(x)
        # Only rank 1 is slow, and only while a GEMM runs in FP8: alone, rank 0 would pick
        # any threshold (they all cost it about the same).
        if rank == 1 and any(m.fp8_last_gemm_backend != "high_precision" for m in model):
            time.sleep(SLOW_S)
        y.sum().backward()

    try:
        tuning = fp8state.tune_fallback(model, step, steps=2, repeats=2, warmup=1)
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


def _worker(rank: int, world: int, store: str, out: str, tokens_differ: bool) -> None:
    init_gloo(rank, world, store)
    try:
        _tune(rank, out, tokens_differ)
    finally:
        shutdown()


def _run(tmp_path, tokens_differ: bool) -> list[dict]:
    args = (2, store_path(str(tmp_path), "tune"), str(tmp_path), tokens_differ)
    run_ranks(_worker, 2, args, timeout=120)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_every_rank_keeps_the_same_threshold(tmp_path) -> None:
    ranks = _run(tmp_path, tokens_differ=False)
    sizes = [16 * H * (H // 2), 16 * H * H]
    assert ranks[0]["gemm_macs"] == ranks[1]["gemm_macs"] == sizes
    assert ranks[0]["ms"] == ranks[1]["ms"]  # reduced: bit for bit the same numbers
    # Only the all-high-precision candidate spares rank 1 the sleep.
    assert ranks[0]["chosen"] == ranks[1]["chosen"] == sizes[1] + 1
    assert ranks[0]["set"] == ranks[1]["set"] == [sizes[1] + 1] * 2


def test_ranks_whose_gemm_sizes_differ_are_refused(tmp_path) -> None:
    ranks = _run(tmp_path, tokens_differ=True)
    for rank in ranks:
        assert "the same GEMM sizes on every rank" in rank["error"]
        assert rank["unchanged"]
