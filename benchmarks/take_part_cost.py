"""What a GEMM that falls back costs when it takes part in the ranks' amax reductions.

Usage: ``python benchmarks/take_part_cost.py [--device cpu|cuda] [--ranks 2] [--layers 16]
[--tokens 64] [--hidden 256] [--steps 50]`` (``--quick``: tiny, for the tests).

Under an amax reduction over several ranks, a module whose GEMM falls back to high precision
still registers for both of the step's reductions (docs/fp8_compute.md, "Ranks that decide
differently"). This runs ``--ranks`` processes, gloo on the CPU or NCCL with a GPU each
(``--device cuda``); each times fwd+bwd steps of a stack of ``fp8state.Linear`` layers whose
GEMMs all fall back, under ``fp8_autocast`` with the world group (every call takes part, and
each step runs its two all-reduces), the same with only the first layer fp8state's (the rest
``nn.Linear``: the all-reduces' cost per step), with a group of its own rank only (nothing is
reduced, nothing takes part), and ``nn.Linear`` layers inside and outside ``fp8_autocast``.
Rank 0 prints milliseconds per step (median of rounds, the cases alternating) and what
taking part costs per fallback call and per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fp8state

_NEVER = 2**62  # a threshold no GEMM here reaches: every call falls back


def _stack(fp8_layers: int, layers: int, hidden: int) -> nn.Sequential:
    """``layers`` linear layers, the first ``fp8_layers`` of them fp8state's (falling back)."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for index in range(layers):
        if index < fp8_layers:
            block = fp8state.Linear(hidden, hidden)
            block.fp8_min_gemm_macs = _NEVER
            blocks.append(block)
        else:
            blocks.append(nn.Linear(hidden, hidden))
    return nn.Sequential(*blocks)


def _step(model: nn.Module, x: torch.Tensor, group: object | None) -> Callable[[], None]:
    def step() -> None:
        if group is None:
            y = model(x)
        else:
            with fp8state.fp8_autocast(fp8_group=group):  # type: ignore[arg-type]
                y = model(x)
        y.sum().backward()
        for p in model.parameters():
            p.grad = None

    return step


def _ms_per_step(step: Callable[[], None], steps: int, device: torch.device) -> float:
    dist.barrier()  # the ranks start each block together: their reductions pair up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps * 1e3


def _rank(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    solos = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    x = torch.randn(args.tokens, args.hidden, device=device)
    layers, hidden, world_group = args.layers, args.hidden, dist.group.WORLD
    all_fp8, one_fp8 = (_stack(n, layers, hidden).to(device) for n in (layers, 1))
    plain = _stack(0, layers, hidden).to(device)
    cases = {
        "every layer fp8state's, world group": _step(all_fp8, x, world_group),
        "the first layer fp8state's, world group": _step(one_fp8, x, world_group),
        "every layer fp8state's, a group of its own rank": _step(all_fp8, x, solos[rank]),
        "nn.Linear layers inside fp8_autocast, world group": _step(plain, x, world_group),
        "nn.Linear layers": _step(plain, x, None),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for step in cases.values():
        _ms_per_step(step, 5, device)  # warm-up
    for _ in range(args.rounds):
        for name, step in cases.items():
            times[name].append(_ms_per_step(step, args.steps, device))
    if rank == 0:
        ms = {name: statistics.median(t) for name, t in times.items()}
        for name, value in ms.items():
            print(f"{name}: {value:.3f} ms/step", flush=True)
        every, first, own, context = (ms[name] for name in list(ms)[:4])
        per_call = (every - first) / (layers - 1) * 1e3
        print(
            f"taking part: {per_call:.1f} us per fallback call, "
            f"{(first - context) * 1e3:.0f} us per step for the two all-reduces of {world} "
            f"ranks (one module taking part); without a group of several ranks: "
            f"{(own - context) / layers * 1e3:.1f} us per fallback call"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny, to test the script")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.tokens, args.hidden, args.steps, args.rounds = 3, 8, 16, 3, 1
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        mp.spawn(_rank, args=(args.ranks, store, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
