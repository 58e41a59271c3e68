"""Where the GPU time of one step of the 16-layer model goes: fp8state, the floor and bf16.

Usage (CUDA): ``python benchmarks/model_kernels.py [--batch 1] [--tokens 2048] [--top 25]
[--norm RMSNorm] [--launches TEXT] [--captured]``.

With the host out of the step (CUDA graphs), a step costs the sum of its kernels. This lists
them for one fwd+bwd of ``transformer.py``'s model: fp8state's layers marked
``fp8_graphed`` (every GEMM in FP8, as the graphed benchmark runs them), the floor's layers
(``host_floor.FloorLinear``: one cast per operand, no amax, transposed operands laid out
beforehand) and ``torch.nn``'s in bf16. Per model: kernels launched, their summed GPU time,
and the kernels by summed time (torch.profiler, CUDA activity), with their counts.
``--norm RMSNorm`` builds all three with RMSNorm in place of LayerNorm (as Llama's layers).
``--launches TEXT`` also prints, per model, every launch of the kernels whose name holds
TEXT, in launch order, in microseconds: where the same kernel costs one model more than
another (e.g. ``--launches CUDAFunctor_add``, the gradients added into ``.grad``).
``--captured`` profiles a replay of each step captured whole in one CUDA graph
(``training_loop.graphed``, as the graphed benchmark runs it) instead of an eager step: the
graph's own kernels, with whatever its capture added (buffers zeroed at every replay).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable

import torch
from host_floor import floor_model_step  # benchmarks/ is on sys.path as a script
from torch.profiler import ProfilerActivity, profile
from training_loop import graphed
from transformer import MODEL, build_model, make_step, mark_graphed


def kernel_launches(step: Callable[[], None]) -> list[tuple[str, float]]:
    """``(kernel name, GPU microseconds)`` of every launch of one call of ``step``, in order."""
    for _ in range(3):  # warm: compile and autotune outside the profile
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return [(e.name, e.device_time) for e in sorted(events, key=lambda e: e.time_range.start)]


def kernel_times(step: Callable[[], None]) -> dict[str, tuple[int, float]]:
    """``{kernel name: (launches, summed GPU microseconds)}`` over one call of ``step``."""
    return tally(kernel_launches(step))


def tally(launches: list[tuple[str, float]]) -> dict[str, tuple[int, float]]:
    """``{kernel name: (launches, summed GPU microseconds)}`` of ``launches``."""
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, us in launches:
        row = table[name[:70]]
        row[0] += 1
        row[1] += us
    return {name: (int(n), us) for name, (n, us) in table.items()}


def report(name: str, table: dict[str, tuple[int, float]], top: int) -> None:
    """Print the totals, then the ``top`` kernels by summed time."""
    launches = sum(n for n, _ in table.values())
    total = sum(us for _, us in table.values())
    print(f"\n{name}: {launches} kernels, {total / 1e3:.3f} ms of GPU time")
    for kernel, (n, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {us / 1e3:8.3f} ms {n:5d}x  {kernel}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="sequences of --tokens per step")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--norm", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    parser.add_argument("--launches", default=None, metavar="TEXT")
    parser.add_argument("--captured", action="store_true", help="profile graph replays")
    args = parser.parse_args()
    device = torch.device("cuda")
    x = torch.randn(args.batch, args.tokens, MODEL["hidden"], device=device, dtype=torch.bfloat16)
    x.requires_grad_()
    grad = torch.randn_like(x)
    fp8_model = build_model(True, device, norm=args.norm)
    mark_graphed(fp8_model, True)  # the graphed threshold: every GEMM in FP8
    steps = {
        "fp8state (graphed threshold)": make_step(fp8_model, x, grad, True),
        "floor": floor_model_step(
            build_model(False, device, args.batch * args.tokens, args.norm), x, grad
        ),
        "bf16": make_step(build_model(False, device, norm=args.norm), x, grad, False),
    }
    for name, step in steps.items():
        launches = kernel_launches(graphed(step) if args.captured else step)
        report(name, tally(launches), args.top)
        if args.launches is not None:
            picked = [f"{us:.1f}" for kernel, us in launches if args.launches in kernel]
            print(f"  {len(picked)} launches holding {args.launches!r}, in order (us):")
            print("  " + " ".join(picked))


if __name__ == "__main__":
    main()
