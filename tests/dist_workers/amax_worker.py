"""Worker of tests/runtime/test_distributed_amax.py: one gloo rank training fp8state modules.

Each rank writes what the test checks to ``<out>/rank<r>.pt``: every module's extra state, the
number of all_reduce calls fp8state made, and the local amaxes it fed in.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist
from _helpers.state import fp8_payloads
from torch import nn
from torch.utils.checkpoint import checkpoint

import fp8state
from dist_workers.launch import shutdown

H = 16


def _model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    return nn.Sequential(fp8state.Linear(H, H), fp8state.LayerNormMLP(H, 32), fp8state.Linear(H, 4))


def run(
    rank: int, world: int, port: int, out: str, mode: str, steps: int, device: str = "cpu"
) -> None:
    """One rank of a test, writing what it checks to ``OUT/rank<r>.pt``.

    gloo on CPU. With ``device="cuda"`` (mode "straddle"): NCCL with a GPU per rank where
    there are enough, else gloo with every rank on the one GPU.
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    backend = "gloo"
    if device == "cuda":
        own_gpu = torch.cuda.device_count() >= world
        device = f"cuda:{rank if own_gpu else 0}"
        torch.cuda.set_device(device)
        backend = "nccl" if own_gpu else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        # A function of its own: the DDP model must be freed before its process group is
        # destroyed (dist_workers.launch.shutdown says why).
        torch.save(_train(rank, mode, steps, device), Path(out) / f"rank{rank}.pt")
    finally:
        shutdown()


def _train(rank: int, mode: str, steps: int, device: str) -> dict:
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
    elif mode == "ahead":  # a twin whose weights are cast ahead, in the same reductions
        dist.all_reduce = counting_all_reduce
        twin = copy.deepcopy(model)
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(8, H, generator=gen) * (rank + 1)
            for m, ahead in ((model, False), (twin, True)):
                block = fp8state.cast_weights_ahead(m, tokens=8)
                with fp8state.fp8_autocast(), block if ahead else contextlib.nullcontext():
                    y = m(x)
                (y * (rank + 1)).sum().backward()
        dist.all_reduce = real_all_reduce
        result["twin"] = fp8_payloads(twin)
    elif mode == "compiled":
        result.update(_compiled(rank, steps, calls, counting_all_reduce, real_all_reduce))
    elif mode == "straddle":
        return _straddle(rank, steps, real_all_reduce, device)
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


# Tokens per rank and a threshold between them: on rank 0 the first Linear (256 MACs a token)
# and the MLP (512 for its smaller GEMM) run in FP8; on rank 1 only the MLP; the head (64)
# falls back on both.
STRADDLE_TOKENS, STRADDLE_MACS = (16, 8), 4096


def _straddle(rank: int, steps: int, real, device: str) -> dict:
    """Batches of another length on each rank: DDP, compiled (``aot_eager``; fp8_autocast
    around the compiled model, and inside a compiled step), checkpointed."""
    eager = _model().to(device)
    compiled, inside, checkpointed = (copy.deepcopy(eager) for _ in range(3))
    for module in [*eager, *compiled, *inside, *checkpointed]:
        module.fp8_min_gemm_macs = STRADDLE_MACS
        if isinstance(module, fp8state.LayerNormMLP) and device != "cpu":
            # Compiled, the MLP runs unfused, and a CUDA cast's GELU is not torch's bit for
            # bit (docs/compile.md): eager runs it unfused too, to compare the bits.
            module.fp8_fuse_activation = False
    forward = torch.compile(compiled, fullgraph=True, backend="aot_eager")

    def forward_inside(x: torch.Tensor) -> torch.Tensor:
        with fp8state.fp8_autocast():
            return inside(x)

    step_inside = torch.compile(forward_inside, fullgraph=True, backend="aot_eager")
    # Its gradient buckets' collectives interleave with fp8state's.
    on_gpu = torch.device(device).type == "cuda"
    ddp = nn.parallel.DistributedDataParallel(eager, device_ids=[device] if on_gpu else None)

    def recomputed(x: torch.Tensor) -> torch.Tensor:  # the forward again, inside backward
        return checkpoint(checkpointed, x.requires_grad_(), use_reentrant=True)

    sizes: list[int] = []

    def noting_all_reduce(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    input_amax, backends = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x = (torch.randn(STRADDLE_TOKENS[rank], H, generator=gen) * (rank + 1)).to(device)
        input_amax.append(float(x.abs().max()))
        dist.all_reduce = noting_all_reduce
        for model in (ddp, forward, recomputed, step_inside):
            with fp8state.fp8_autocast() if model is not step_inside else contextlib.nullcontext():
                y = model(x)
            y.relu_()  # in place on the head's output, which fell back: as after any Linear
            y.sum().backward()
        dist.all_reduce = real
        backends.append([m.fp8_last_gemm_backend for m in eager])
    return {
        "sizes": sizes,
        "input_amax": input_amax,
        "backends": backends,
        "eager": fp8_payloads(eager),
        "compiled": fp8_payloads(compiled),
        "inside": fp8_payloads(inside),
        "checkpointed": fp8_payloads(checkpointed),
    }
