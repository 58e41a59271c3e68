"""Worker of tests/compile/test_compiled_data_parallel.py: one gloo rank, compiled and eager.

Trains the same model compiled (``aot_eager``) and eagerly under the same data-parallel
wrapper (DDP or FSDP2), and writes both models' losses, full parameters and FP8 payloads,
and the number of graphs compiled, to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.testing
import torch.distributed as dist
from _helpers.state import fp8_payloads
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fp8state
from dist_workers.launch import init_gloo, shutdown

H = 256  # weights of 1 MB: DDP's smallest bucket holds one
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    layers = fp8state.LayerNormLinear(H, 4 * H), fp8state.Linear(4 * H, H)
    return nn.Sequential(*layers, fp8state.LayerNormMLP(H, 4 * H))


def run(rank: int, world: int, store: str, out: str, case: str) -> None:
    """One rank of ``case``: "ddp-outside" (the DDP model compiled, ``fp8_autocast`` around
    it), "ddp-inside" (a compiled step calling the DDP model, the context inside), "fsdp2"
    (each layer compiled, then sharded) or "fsdp2-whole" (the sharded model compiled)."""
    init_gloo(rank, world, store)
    try:
        # A function of its own: DDP models must be freed before the group is destroyed
        # (dist_workers.launch.shutdown says why).
        torch.save(_train(rank, case), Path(out) / f"rank{rank}.pt")
    finally:
        shutdown()


def _ddp(model: nn.Module) -> nn.Module:
    # Buckets of 1 MB (DDP's first bucket's size, the least Dynamo takes): a weight each, so
    # the graph is split into several pieces.
    return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)


def _fsdp2(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step_inside(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with fp8state.fp8_autocast():
        return model(x).pow(2).mean()


def _step_outside(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with fp8state.fp8_autocast():
        y = model(x)
    return y.pow(2).mean()


def _runs(case: str, model: nn.Module, twin: nn.Module, backend: Any) -> tuple[tuple, tuple]:
    """(model, step) compiled as ``case`` says, and its eager twin's."""
    if case == "ddp-inside":  # the step compiled, calling the DDP model
        compiled = (_ddp(model), torch.compile(_step_inside, backend=backend))
        return compiled, (_ddp(twin), _step_inside)
    if case == "ddp-outside":  # the DDP model compiled
        return (torch.compile(_ddp(model), backend=backend), _step_outside), (
            _ddp(twin),
            _step_outside,
        )
    if case == "fsdp2-whole":  # the sharded model compiled whole
        return (torch.compile(_fsdp2(model), backend=backend), _step_outside), (
            _fsdp2(twin),
            _step_outside,
        )
    # FSDP2 with each layer compiled before it is sharded, as torchtitan does: FSDP2's
    # all-gathers and reduce-scatters run between the layers' graphs.
    for layer in model:
        layer.compile(backend=backend)
    return (_fsdp2(model), _step_outside), (_fsdp2(twin), _step_outside)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # FSDP2's parameters are DTensors
    return (full() if full is not None else tensor).detach()


def _train(rank: int, case: str) -> dict:
    model = _model()
    twin = copy.deepcopy(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    runs = _runs(case, model, twin, counter)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]
    losses: list[list[torch.Tensor]] = [[], []]
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(8, H, generator=gen) * (rank + 1)
        for i, (wrapped, run_step) in enumerate(runs):
            loss = run_step(wrapped, x)
            loss.backward()
            optimizers[i].step()
            optimizers[i].zero_grad()
            losses[i].append(loss.detach())
    dist.barrier()
    return {
        "graphs": counter.frame_count,
        "losses": losses,
        "params": [[_full(p) for p in m.parameters()] for m in (model, twin)],
        "payloads": [fp8_payloads(m) for m in (model, twin)],
    }
