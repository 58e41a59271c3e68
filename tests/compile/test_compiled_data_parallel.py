"""Compiled data-parallel training on two gloo ranks: the eager DDP or FSDP2 step, bit for bit.

- ``torch.compile(DistributedDataParallel(model))`` ("ddp-outside", ``fp8_autocast`` around
  the call) and a compiled step calling a DDP model ("ddp-inside", the context inside):
  Dynamo's DDP optimizer splits the step at the gradient buckets' boundaries, so fp8state's
  operators of one step run in several graphs with DDP's all-reduces between them.
- FSDP2 (``fully_shard``) with each layer compiled before it is sharded, as torchtitan does
  ("fsdp2"), and the sharded model compiled whole ("fsdp2-whole"): a graph per layer, FSDP2's
  all-gathers and reduce-scatters between them.

With ``aot_eager``, three AdamW steps must equal the eager twin's (DDP or FSDP2) bit for bit:
losses, parameters, FP8 metadata; and both ranks must hold the same model.
"""

from __future__ import annotations

import pytest
import torch
from _helpers.state import assert_same
from dist_workers.compiled_parallel_worker import STEPS, run
from dist_workers.launch import run_ranks, store_path

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("case", ["ddp-outside", "ddp-inside", "fsdp2", "fsdp2-whole"])
def test_compiled_data_parallel_training_equals_eager(tmp_path, case: str) -> None:
    world = 2
    store = store_path(str(tmp_path), case)
    run_ranks(run, world, (world, store, str(tmp_path), case), timeout=300)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    for r in results:
        # The step ran as several graphs, collectives between them: one per layer under FSDP2,
        # split at the gradient buckets' boundaries under the DDP optimizer.
        if case.startswith("fsdp2"):
            assert r["graphs"] == 3
        else:
            assert r["graphs"] > 1
        for key in ("losses", "params", "payloads"):
            compiled, eager = r[key]
            assert_same(compiled, eager, where=key)
        # The FP8 metadata moved: every step recorded and updated.
        head = r["payloads"][0]["0"]
        assert head["fwd.amax_history"][:STEPS].amax(dim=1).gt(0).all()
    assert_same(results[1]["payloads"], results[0]["payloads"])
    assert_same(results[1]["params"], results[0]["params"])
