"""Where an FP8 Linear step spends its time, and how fast the fused cast kernel runs.

Usage (CUDA + Triton): ``python benchmarks/profile_linear.py [--shape 16384x4096x4096]``.
Prints the top CUDA kernels of three fwd+bwd steps (torch.profiler) and, for the cast kernel
on an input-sized bf16 tensor, GB/s per block configuration with and without the transpose.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import fp8state
from fp8state.kernels.triton_cast import cast_transpose_amax, default_config

CONFIGS = [(8, 128, 4), (16, 128, 4), (16, 128, 8), (32, 128, 8), (32, 64, 4), (64, 64, 8),
           (8, 256, 8)]


def _time_ms(fn, iters: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        fn()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16384x4096x4096")
    args = parser.parse_args()
    tokens, k, n = map(int, args.shape.split("x"))
    layer = fp8state.Linear(k, n, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        with fp8state.fp8_autocast():
            y = layer(x)
        y.backward(grad)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18,
                                      max_name_column_width=60)
    print(table)
    print(f"step {_time_ms(step, 20):.3f} ms; default cast configs "
          f"{default_config(tokens, False)} / {default_config(tokens, True)} (transpose)")

    scale = torch.tensor([1.0], device="cuda")
    cell = torch.zeros(1, device="cuda")
    for transpose in (False, True):
        moved = x.numel() * (2 + (2 if transpose else 1))
        for cfg in CONFIGS:
            ms = _time_ms(lambda cfg=cfg, transpose=transpose: cast_transpose_amax(
                x.detach(), scale, torch.float8_e4m3fn, cell, transpose, cfg))
            print(f"cast transpose={transpose} config={cfg}: {ms * 1e3:.1f} us, "
                  f"{moved / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()
