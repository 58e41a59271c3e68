"""Worker of tests/compile/test_compiled_ddp.py: one gloo rank training a compiled DDP model.

``torch.compile(DistributedDataParallel(model))``, the usual way to compile data-parallel
training: Dynamo's DDP optimizer splits the graph at the gradient buckets' boundaries and
compiles each piece. Next to it, the same model under eager DDP. Each rank writes both
models' losses, parameters and FP8 payloads, and the number of graphs compiled, to
``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch._dynamo.testing
import torch.distributed as dist
from _helpers.state import fp8_payloads
from torch import nn

import fp8state
from dist_workers.launch import init_gloo, shutdown

H = 256  # weights of 1 MB: DDP's smallest bucket holds one
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    layers = fp8state.LayerNormLinear(H, 4 * H), fp8state.Linear(4 * H, H)
    return nn.Sequential(*layers, fp8state.LayerNormMLP(H, 4 * H))


def run(rank: int, world: int, store: str, out: str, where: str) -> None:
    """One rank: ``where`` the ``fp8_autocast`` is, "outside" or "inside" the compiled step."""
    init_gloo(rank, world, store)
    try:
        # A function of its own: DDP models must be freed before the group is destroyed
        # (dist_workers.launch.shutdown says why).
        torch.save(_train(rank, where), Path(out) / f"rank{rank}.pt")
    finally:
        shutdown()


def _ddp(model: nn.Module) -> nn.Module:
    # Buckets of 1 MB (DDP's first bucket's size, the least Dynamo takes): a weight each, so
    # the graph is split into several pieces.
    return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)


def _train(rank: int, where: str) -> dict:
    model = _model()
    twin = copy.deepcopy(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    eager = _ddp(twin)

    def step_inside(ddp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with fp8state.fp8_autocast():
            return ddp(x).pow(2).mean()

    def step_outside(ddp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with fp8state.fp8_autocast():
            y = ddp(x)
        return y.pow(2).mean()

    if where == "inside":  # the step compiled, calling the DDP model
        runs = ((_ddp(model), torch.compile(step_inside, backend=counter)), (eager, step_inside))
    else:  # the DDP model compiled
        runs = ((torch.compile(_ddp(model), backend=counter), step_outside), (eager, step_outside))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]
    losses: list[list[torch.Tensor]] = [[], []]
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(8, H, generator=gen) * (rank + 1)
        for i, (ddp, run_step) in enumerate(runs):
            loss = run_step(ddp, x)
            loss.backward()
            optimizers[i].step()
            optimizers[i].zero_grad()
            losses[i].append(loss.detach())
    dist.barrier()
    return {
        "graphs": counter.frame_count,
        "losses": losses,
        "params": [[p.detach() for p in m.parameters()] for m in (model, twin)],
        "payloads": [fp8_payloads(m) for m in (model, twin)],
    }
