"""Where the GPU time of one step of the 16-layer model goes: fp8state, the floor and bf16.

Usage (CUDA): ``python benchmarks/model_kernels.py [--batch 1] [--tokens 2048] [--top 25]
[--norm RMSNorm]``.

With the host out of the step (CUDA graphs), a step costs the sum of its kernels. This lists
them for one fwd+bwd of ``transformer.py``'s model: fp8state's layers marked
``fp8_graphed`` (every GEMM in FP8, as the graphed benchmark runs them), the floor's layers
(``host_floor.FloorLinear``: one cast per operand, no amax, transposed operands laid out
beforehand) and ``torch.nn``'s in bf16. Per model: kernels launched, their summed GPU time,
and the kernels by summed time (torch.profiler, CUDA activity), with their counts.
``--norm RMSNorm`` builds all three with RMSNorm in place of LayerNorm (as Llama's layers).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable

import torch
from host_floor import floor_model_step  # benchmarks/ is on sys.path as a script
from torch.profiler import ProfilerActivity, profile
from transformer import MODEL, build_model, make_step, mark_graphed


def kernel_times(step: Callable[[], None]) -> dict[str, tuple[int, float]]:
    """``{kernel name: (launches, summed GPU microseconds)}`` over one call of ``step``."""
    for _ in range(3):  # warm: compile and autotune outside the profile
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type.name == "CUDA":
            row = table[event.name[:70]]
            row[0] += 1
            row[1] += event.device_time
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
        report(name, kernel_times(step), args.top)


if __name__ == "__main__":
    main()
