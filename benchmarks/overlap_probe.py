"""What running a weight's FP8 cast beside other kernels saves, inside one CUDA graph.

Usage (CUDA): ``python benchmarks/overlap_probe.py [--reps 20]``.

A weight's cast depends on nothing the step computes, so a graph could run it on a second
stream beside a kernel of the forward (a GEMM, attention, a LayerNorm, another cast). For
pairs ``A`` (the forward's kernel) and ``B`` (a weight's cast with its transposed copy and
amax, fp8state's kernel) of the 16-layer model at 2048 tokens, this captures ``--reps``
pairs into one graph four ways and prints device microseconds per pair (median of replays,
CUDA events): ``A`` alone, ``B`` alone, ``A`` then ``B`` on one stream, and ``B`` on a second
stream beside ``A`` (fork and join per pair).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fp8state._kernels.cast_launch import cast_transpose_amax

TOKENS, HIDDEN, FFN, HEADS = 2048, 2048, 8192, 16
E4M3 = torch.float8_e4m3fn


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def weight_cast(rows: int, cols: int) -> Callable[[], object]:
    """fp8state's cast of a ``rows x cols`` bf16 weight, transposed copy and amax included."""
    w, scale, cell = _bf16(rows, cols), torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    return lambda: cast_transpose_amax(w, scale, E4M3, cell, transpose=True)


def fp8_gemm(m: int, k: int, n: int) -> Callable[[], object]:
    """An FP8 GEMM with a bias as a forward runs it: ``(m, k) @ (k, n)``."""
    a = _bf16(m, k).to(E4M3)
    b = _bf16(n, k).to(E4M3).t()
    one, bias = torch.ones((), device="cuda"), _bf16(n)
    return lambda: torch._scaled_mm(
        a, b, one, one, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True
    )


def attention() -> Callable[[], object]:
    """Causal SDPA of one 2048-token sequence, 16 heads."""
    q, k, v = (_bf16(1, HEADS, TOKENS, HIDDEN // HEADS) for _ in range(3))
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)


def layer_norm() -> Callable[[], object]:
    """The pre-LN LayerNorm of 2048 tokens."""
    x, w, b = _bf16(TOKENS, HIDDEN), _bf16(HIDDEN), _bf16(HIDDEN)
    return lambda: F.layer_norm(x, (HIDDEN,), w, b)


def graph_us(body: Callable[[], None], reps: int, replays: int = 30) -> float:
    """Median device microseconds per repetition of ``body``, captured ``reps`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, autotune) outside the capture
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            body()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def pair_us(a: Callable[[], object], b: Callable[[], object], reps: int) -> dict[str, float]:
    """``a`` alone, ``b`` alone, one after the other, and ``b`` on a second stream beside."""
    side = torch.cuda.Stream()

    def forked() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            b()
        a()
        main.wait_stream(side)

    bodies = {"A": a, "B": b, "A then B": lambda: (a(), b()), "B beside A": forked}
    return {name: round(graph_us(body, reps), 1) for name, body in bodies.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="pairs captured per graph")
    args = parser.parse_args()
    t, h, f = TOKENS, HIDDEN, FFN
    pairs = {
        "fc1 GEMM | fc2 weight cast": (fp8_gemm(t, h, f), weight_cast(h, f)),
        "fc2 GEMM | fc1 weight cast": (fp8_gemm(t, f, h), weight_cast(f, h)),
        "qkv GEMM | fc1 weight cast": (fp8_gemm(t, h, 3 * h), weight_cast(f, h)),
        "attention | proj weight cast": (attention(), weight_cast(h, h)),
        "attention | fc1 weight cast": (attention(), weight_cast(f, h)),
        "LayerNorm | qkv weight cast": (layer_norm(), weight_cast(3 * h, h)),
        "input cast | qkv weight cast": (weight_cast(t, h), weight_cast(3 * h, h)),
    }
    for name, (a, b) in pairs.items():
        times = pair_us(a, b, args.reps)
        saved = times["A then B"] - times["B beside A"]
        print(f"{name}: {times} -> saves {saved:.1f} us of {times['B']:.1f}", flush=True)


if __name__ == "__main__":
    main()
