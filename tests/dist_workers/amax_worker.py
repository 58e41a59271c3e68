"""Worker of tests/runtime/test_distributed_amax.py: one gloo rank training fp8state modules.

Each rank writes what the test checks to ``<out>/rank<r>.pt``: every module's extra state, the
number of all_reduce calls fp8state made, and the local amaxes it fed in.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist
from _helpers.state import fp8_payloads
from torch import nn

import fp8state
from dist_workers.launch import shutdown

H = 16


def _model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    return nn.Sequential(fp8state.Linear(H, H), fp8state.LayerNormMLP(H, 32), fp8state.Linear(H, 4))


def run(rank: int, world: int, port: int, out: str, mode: str, steps: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # A function of its own: the DDP model must be freed before its process group is
        # destroyed (dist_workers.launch.shutdown says why).
        torch.save(_train(rank, mode, steps), Path(out) / f"rank{rank}.pt")
    finally:
        shutdown()


def _train(rank: int, mode: str, steps: int) -> dict:
    model = _model()
    calls = {"all_reduce": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls["all_reduce"] += 1
        return real_all_reduce(*args, **kwargs)

    result: dict = {}
    if mode == "count":
        dist.all_reduce = counting_all_reduce
        input_amax = []
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(8, H, generator=gen) * (rank + 1)
            input_amax.append(float(x.abs().max()))
            with fp8state.fp8_autocast():
                y = model(x)
            (y * (rank + 1)).sum().backward()  # grad_output of the head is rank + 1
        dist.all_reduce = real_all_reduce
        result["input_amax"] = input_amax
    elif mode == "compiled":
        result.update(_compiled(rank, steps, calls, counting_all_reduce, real_all_reduce))
    else:  # "ddp": ordinary data-parallel training, different data per rank
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        losses = []
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(16, H, generator=gen)
            with fp8state.fp8_autocast():
                y = ddp(x)
            loss = (y - x[:, :4].sin()).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        result["losses"] = losses
    result["calls"] = calls["all_reduce"]
    result["payloads"] = fp8_payloads(model)
    return result


def _compiled(rank: int, steps: int, calls: dict, counting, real) -> dict:
    """Compiled steps (``aot_eager``) next to eager twins: around and inside the graph."""
    outside, inside = _model(), _model()
    twins = [copy.deepcopy(outside), copy.deepcopy(inside)]
    forward = torch.compile(outside, fullgraph=True, backend="aot_eager")

    def loss_inside(x: torch.Tensor) -> torch.Tensor:
        with fp8state.fp8_autocast(fp8_group=dist.group.WORLD):
            return inside(x).sum()

    step_inside = torch.compile(loss_inside, fullgraph=True, backend="aot_eager")
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(8, H, generator=gen) * (rank + 1)
        dist.all_reduce = counting
        with fp8state.fp8_autocast():
            forward(x).sum().backward()
        step_inside(x).backward()
        dist.all_reduce = real
        for twin in twins:
            with fp8state.fp8_autocast():
                twin(x).sum().backward()
    return {
        "outside": fp8_payloads(outside),
        "inside": fp8_payloads(inside),
        "twins": [fp8_payloads(twin) for twin in twins],
    }
