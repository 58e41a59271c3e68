"""Where the host's time goes in one training step of the 16-layer model, eager and compiled.

Usage (CUDA): ``python benchmarks/profile_step.py [--batch 1] [--tokens 2048] [--modes eager
compiled] [--every-gemm-fp8]``.

For each mode and for fp8state and bf16: host milliseconds per fwd+bwd step launched back to
back (the GPU not waited for: a host-bound step shows its host time), synchronized
milliseconds per step, on CUDA the summed GPU time of one step's kernels (what the step would
take if the host never made the GPU wait), and the Python functions that take the host's time
(cProfile, sorted by own time, then by cumulative time). ``--quick`` runs tiny shapes, on CPU
too.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch
from hopper import sync  # benchmarks/ is on sys.path as a script
from model_kernels import kernel_times
from transformer import build_model, make_step, mark_graphed


def timed_ms(step: Callable[[], None], device: torch.device, iters: int) -> tuple[float, float]:
    """(host ms per step, GPU not waited for; synchronized ms per step)."""
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    host = time.perf_counter() - start
    sync(device)
    wall = time.perf_counter() - start
    return host / iters * 1e3, wall / iters * 1e3


def profiled(step: Callable[[], None], device: torch.device, iters: int, top: int) -> str:
    """cProfile's view of ``iters`` steps: the ``top`` functions by own and cumulative time."""
    profiler = cProfile.Profile()
    sync(device)
    profiler.enable()
    for _ in range(iters):
        step()
    profiler.disable()
    sync(device)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1, help="sequences of --tokens per step")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--modes", nargs="*", default=["eager", "compiled"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, to test the script")
    parser.add_argument(
        "--every-gemm-fp8",
        action="store_true",
        help="the graphed threshold (every GEMM of the model in FP8) instead of the eager one",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = {"layers": 2, "hidden": 64, "ffn": 128, "heads": 4} if args.quick else {}
    tokens = 16 if args.quick else args.tokens
    hidden = shape.get("hidden", 2048)
    x = torch.randn(
        args.batch, tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True
    )
    grad = torch.randn_like(x)
    for mode in args.modes:
        for fp8 in (True, False):
            model = build_model(fp8, device, **shape)
            mark_graphed(model, args.every_gemm_fp8)
            if mode == "compiled":
                model = torch.compile(model)
            step = make_step(model, x, grad, fp8)
            for _ in range(3):  # warm-up (and compilation)
                step()
            host, wall = timed_ms(step, device, args.iters)
            name = f"{mode} {'fp8state' if fp8 else 'bf16'}"
            print(f"== {name}: host {host:.2f} ms/step, synchronized {wall:.2f} ms/step")
            if device.type == "cuda":
                kernel_ms = sum(us for _, us in kernel_times(step).values()) / 1e3
                print(f"   GPU kernels of one step: {kernel_ms:.2f} ms")
            if fp8:
                print(profiled(step, device, args.iters, args.top))


if __name__ == "__main__":
    main()
