"""``torch.compile(DistributedDataParallel(model))`` on two gloo ranks: eager DDP's training.

Dynamo's DDP optimizer splits the compiled graph at the gradient buckets' boundaries, so
fp8state's operators of one step run in several graphs, with DDP's all-reduces between them.
With ``aot_eager``, every step must still be the eager DDP step, bit for bit (losses,
parameters after AdamW, FP8 metadata), with ``fp8_autocast`` around the compiled model or
inside the compiled step, and identical on both ranks.
"""

from __future__ import annotations

import pytest
import torch
from _helpers.state import assert_same
from dist_workers.compiled_ddp_worker import run
from dist_workers.launch import run_ranks, store_path

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_compiled_ddp_trains_as_eager_ddp(tmp_path, where: str) -> None:
    world = 2
    store = store_path(str(tmp_path), where)
    run_ranks(run, world, (world, store, str(tmp_path), where), timeout=300)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    for r in results:
        assert r["graphs"] > 1  # the DDP optimizer split the step's graph
        for key in ("losses", "params", "payloads"):
            compiled, eager = r[key]
            assert_same(compiled, eager, where=key)
        # The FP8 metadata moved: every step recorded and updated.
        head = r["payloads"][0]["0"]
        assert head["fwd.amax_history"][:3].amax(dim=1).gt(0).all()
    assert_same(results[1]["payloads"], results[0]["payloads"])
    assert_same(results[1]["params"], results[0]["params"])
