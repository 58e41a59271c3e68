"""Amax reduction across gloo ranks: one collective per direction per step, identical scales."""

from __future__ import annotations

import pytest
import torch
from _helpers.state import assert_same
from _helpers.straddle import assert_ranks_reduced_alike
from dist_workers.amax_worker import run
from dist_workers.launch import free_port, run_ranks

pytestmark = pytest.mark.slow


def _spawn(tmp_path, world: int, mode: str, steps: int) -> list[dict]:
    run_ranks(run, world, (world, free_port(), str(tmp_path), mode, steps), timeout=180)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _assert_same_payloads(results: list[dict]) -> None:
    for other in results[1:]:
        assert_same(other["payloads"], results[0]["payloads"])


def test_three_ranks_one_collective_per_direction_per_step(tmp_path) -> None:
    world, steps = 3, 3
    results = _spawn(tmp_path, world, "count", steps)
    for r in results:
        # 3 FP8 modules, yet one all_reduce forward and one backward per step.
        assert r["calls"] == 2 * steps
    _assert_same_payloads(results)
    first = results[0]["payloads"]["0"]
    hist = first["fwd.amax_history"]
    for k in range(steps):  # row k holds step (steps-1-k), reduced with max over ranks
        global_max = max(r["input_amax"][steps - 1 - k] for r in results)
        assert hist[k, 0] == torch.tensor(global_max, dtype=torch.float32)
    window_amax = hist[:steps, 0].max()
    assert first["fwd.scale"][0] == torch.tensor(448.0) / window_amax
    head = results[0]["payloads"]["2"]
    assert head["bwd.amax_history"][0, 0] == world  # max over ranks of grad_output = rank + 1
    assert head["bwd.scale"][0] == torch.tensor(57344.0) / world


def test_weights_cast_ahead_reduce_as_the_plain_steps(tmp_path) -> None:
    # On two gloo ranks with different data, a twin whose steps cast their weights ahead
    # (fp8state.cast_weights_ahead) joins one collective per direction per step and ends
    # with the plain model's metadata, bit for bit, the same on both ranks.
    steps = 3
    results = _spawn(tmp_path, 2, "ahead", steps)
    for r in results:
        assert r["calls"] == 2 * 2 * steps  # two models, forward and backward
        assert_same(r["twin"], r["payloads"])
    _assert_same_payloads(results)


def test_ddp_training_keeps_metadata_identical_on_every_rank(tmp_path) -> None:
    results = _spawn(tmp_path, 2, "ddp", 15)
    _assert_same_payloads(results)
    for r in results:
        assert r["calls"] == 0  # counting was off in this mode
        assert r["losses"][-1] < r["losses"][0]


def test_compiled_steps_reduce_as_eager_steps(tmp_path) -> None:
    # torch.compile (aot_eager) with fp8_autocast around the compiled model and inside the
    # compiled step, over two gloo ranks: one collective per direction per step, and the
    # metadata of an eager twin, bit for bit, identical on both ranks.
    steps = 3
    results = _spawn(tmp_path, 2, "compiled", steps)
    for r in results:
        assert r["calls"] == 2 * 2 * steps  # two compiled models, forward and backward
        assert_same(r["outside"], r["twins"][0])
        assert_same(r["inside"], r["twins"][1])
    for key in ("outside", "inside"):
        assert_same(results[1][key], results[0][key])


def test_ranks_whose_batches_put_a_gemm_on_both_sides_of_the_threshold(tmp_path) -> None:
    # Rank 0 runs the first Linear in FP8, rank 1 falls back there (fewer tokens); the head
    # falls back on both. Every rank still reduces every module, in the same order.
    steps = 3
    results = _spawn(tmp_path, 2, "straddle", steps)
    assert_ranks_reduced_alike(results, steps)
    assert results[0]["backends"][0][:2] == ["emulated", "emulated"]
