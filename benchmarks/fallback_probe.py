"""What a GEMM below the FP8 threshold costs: fp8state's high-precision fallback against nn.Linear.

Usage (CUDA): ``python benchmarks/fallback_probe.py [--shape 8192x2048x2048]``.

Times fwd+bwd steps as ``training_loop.py``'s sweep does (:func:`hopper.steady_pair_ms`), in
both orders, for: ``nn.Linear`` alone, ``nn.Linear`` inside ``fp8_autocast`` (the context's
own cost), and ``fp8state.Linear`` falling back to high precision; then lists the kernels of
one step of each (``torch.profiler``), which must be the same.

``--host [--device cpu]``: host microseconds per call on tiny tensors (the kernels cost
next to nothing, so what is left is Python and dispatch), on any device: an empty
``fp8_autocast``, the forward of ``nn.Linear`` and of ``fp8state.Linear`` falling back
inside it, and the fwd+bwd steps above. Rounds alternate between the cases; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from hopper import spin_up, steady_pair_ms  # benchmarks/ is on sys.path as a script
from torch import nn
from torch.profiler import ProfilerActivity, profile
from transformer import make_step

import fp8state


def _kernels(step: Callable[[], None]) -> list[str]:
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def host_us(device: torch.device, rounds: int, calls: int) -> dict[str, float]:
    """Median host microseconds per call of each case (tiny shapes: the host's share)."""
    x = torch.randn(8, 16, device=device, requires_grad=True)
    grad = torch.randn(8, 16, device=device)
    plain = nn.Linear(16, 16, device=device)
    fallback = fp8state.Linear(16, 16, device=device)
    fallback.fp8_min_gemm_macs = 2**62  # every call falls back

    def empty() -> None:
        with fp8state.fp8_autocast():
            pass

    def forward(module: nn.Module) -> Callable[[], None]:
        def call() -> None:
            with fp8state.fp8_autocast():
                module(x)

        return call

    cases = {
        "fp8_autocast enter+exit": empty,
        "nn.Linear forward in fp8_autocast": forward(plain),
        "fp8state.Linear fallback forward in fp8_autocast": forward(fallback),
        "nn.Linear step": make_step(plain, x, grad, False),
        "nn.Linear step in fp8_autocast": make_step(plain, x, grad, True),
        "fp8state.Linear fallback step": make_step(fallback, x, grad, True),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            start = time.perf_counter()
            for _ in range(calls):
                case()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    assert fallback.fp8_last_gemm_backend == "high_precision"
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x2048x2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--host", action="store_true", help="host us per call, tiny tensors")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if args.host:
        for name, us in host_us(torch.device(args.device), args.rounds, args.calls).items():
            print(f"{name}: {us} us")
        return
    m, k, n = (int(v) for v in args.shape.split("x"))
    device = torch.device("cuda")
    spin_up(device, 2.0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    torch.manual_seed(0)
    plain = nn.Linear(k, n, device=device, dtype=torch.bfloat16)
    fallback = fp8state.Linear(k, n, params_dtype=torch.bfloat16, device=device)
    fallback.fp8_min_gemm_macs = m * k * n + 1  # high precision at this shape
    steps = {
        "nn.Linear": make_step(plain, x, grad, False),
        "nn.Linear in fp8_autocast": make_step(plain, x, grad, True),  # the context alone
        "fp8state.Linear fallback": make_step(fallback, x, grad, True),
    }
    base = steps["nn.Linear"]
    for name, step in steps.items():
        for _ in range(args.rounds):
            ab = steady_pair_ms(base, step, device, 5, 10)
            ba = steady_pair_ms(step, base, device, 5, 10)
            print(
                f"{name}: nn.Linear/this {ab[0] / ab[1]:.3f} (this second), "
                f"{ba[1] / ba[0]:.3f} (this first); ms {ab[1]:.4f} {ba[0]:.4f}"
            )
    assert fallback.fp8_last_gemm_backend == "high_precision"
    for name, step in steps.items():
        print(name, _kernels(step))


if __name__ == "__main__":
    main()
