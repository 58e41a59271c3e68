"""``recalibrate`` on 2 gloo ranks: amaxes are reduced over the group, scales agree everywhere."""

from __future__ import annotations

import pytest
import torch
from _helpers.state import assert_same, fields
from dist_workers.launch import init_gloo, run_ranks, shutdown, store_path
from torch import nn

import fp8state

pytestmark = pytest.mark.slow

H, OUT, BATCHES = 8, 4, 3


def _calibrate(rank: int, out: str, ddp: bool) -> None:
    torch.manual_seed(0)  # the same weights on every rank
    model: nn.Module = nn.Sequential(fp8state.Linear(H, H), fp8state.Linear(H, OUT))
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(100 + rank)
    # Different data per rank; rank 1's inputs and gradients are larger.
    batches = [
        (
            torch.randn(4, H, generator=gen) * (rank + 1),
            torch.randn(4, OUT, generator=gen) * (rank + 1),
        )
        for _ in range(BATCHES)
    ]
    report = fp8state.recalibrate(
        model,
        batches,
        forward_fn=lambda m, b: m(b[0]),
        loss_fn=lambda o, b: (o * b[1]).sum(),  # the head's grad_output is b[1]
    )
    inner = model.module if ddp else model
    torch.save(
        {
            "modules": list(report.modules),
            "payloads": {n: inner.get_submodule(n).get_extra_state() for n in report.modules},
            "input_amax": max(float(x.abs().max()) for x, _ in batches),
            "grad_amax": max(float(g.abs().max()) for _, g in batches),
        },
        f"{out}/rank{rank}.pt",
    )


def _worker(rank: int, world: int, store: str, out: str, ddp: bool) -> None:
    init_gloo(rank, world, store)
    try:
        # A function of its own: the DDP model must be freed before its process group is
        # destroyed (a reducer outliving it can hang or abort the process at exit).
        _calibrate(rank, out, ddp)
    finally:
        shutdown()


@pytest.mark.parametrize("ddp", [False, True], ids=["plain", "ddp"])
def test_amaxes_are_reduced_over_ranks(tmp_path, ddp: bool) -> None:
    run_ranks(_worker, 2, (2, store_path(str(tmp_path), "recal"), str(tmp_path), ddp), timeout=120)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0]["modules"] == ranks[1]["modules"] == ["0", "1"]
    assert_same(ranks[1]["payloads"], ranks[0]["payloads"])
    first, head = (fields(ranks[0]["payloads"][n]) for n in ("0", "1"))
    input_amax = torch.tensor(max(r["input_amax"] for r in ranks))
    assert ranks[1]["input_amax"] > ranks[0]["input_amax"]  # rank 0 alone would differ
    assert first["fwd.amax_history"][0, 0] == input_amax
    assert torch.equal(first["fwd.scale"][0], torch.tensor(448.0) / input_amax)
    grad_amax = torch.tensor(max(r["grad_amax"] for r in ranks))
    assert head["bwd.amax_history"][0, 0] == grad_amax
    assert torch.equal(head["bwd.scale"][0], torch.tensor(57344.0) / grad_amax)
