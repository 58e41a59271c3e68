"""Where an FP8 Linear step spends its time, and how fast the fused cast kernel runs.

Usage (CUDA + Triton): ``python benchmarks/profile_linear.py [--shape 16384x4096x4096]
[--mlp]`` (``--mlp``: a LayerNormMLP of tokens x hidden x ffn instead of a Linear).
Prints every CUDA kernel of three fwd+bwd steps (torch.profiler, the benchmark's step), where
the GPU idles when steps are queued ahead of it and, for the cast kernel on an input-sized
bf16 tensor, GB/s per block configuration with and without the transpose.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from hopper import fwd_bwd, kernel_ms  # the benchmark's (benchmarks/ is on sys.path)
from torch.profiler import ProfilerActivity, profile

import fp8state
from fp8state._kernels import cast_launch
from fp8state._kernels.cast_launch import default_config

_CUDA = torch.device("cuda")

# (BLOCK_M, BLOCK_N, num_warps, split) candidates for each layout (transpose, column sums).
_TILES = [
    (bm, bn, w)
    for bm in (16, 32, 64, 128)
    for bn in (32, 64, 128, 256)
    for w in (4, 8)
    if 1024 <= bm * bn <= 16384
]
CONFIGS = {
    (False, False): [
        (8, 256, 8, 1),
        (16, 256, 8, 1),
        (8, 512, 8, 1),
        (8, 256, 4, 1),
        (8, 256, 8, 2),
        (8, 256, 8, 4),
        (8, 256, 8, 8),
    ],
    (True, False): [(bm, bn, w, sp) for bm, bn, w in _TILES for sp in (1, 2, 4, 8, 16, 32)],
}
# With column sums the split is along the rows: 4-64 programs per column tile.
_SUM_TILES = [
    (16, 128, 4),
    (16, 128, 8),
    (16, 256, 8),
    (32, 64, 4),
    (32, 128, 4),
    (32, 128, 8),
    (32, 256, 8),
    (64, 64, 4),
    (64, 64, 8),
    (64, 128, 8),
]
CONFIGS[False, True] = CONFIGS[True, True] = [
    (bm, bn, w, sp) for bm, bn, w in _SUM_TILES for sp in (4, 8, 16, 32, 64)
]


def _config(text: str) -> tuple[int, int, int, int]:
    """``"64x128x4x16"`` -> ``(64, 128, 4, 16)``: a ``--configs`` entry."""
    try:
        block_m, block_n, warps, split = (int(v) for v in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: BLOCK_MxBLOCK_NxWARPSxSPLIT, four integers"
        ) from None
    return block_m, block_n, warps, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16384x4096x4096")
    parser.add_argument(
        "--mlp",
        action="store_true",
        help="profile LayerNormMLP(in, out) instead (tokens x hidden x ffn)",
    )
    parser.add_argument("--sweep-only", action="store_true", help="skip the step profile")
    parser.add_argument(
        "--cast-shape", default=None, help="MxN of the swept cast (default: the input's shape)"
    )
    parser.add_argument(
        "--op",
        default="identity",
        choices=("identity", "gelu", "dgelu"),
        help="what the swept cast computes before quantizing",
    )
    parser.add_argument(
        "--default-only",
        action="store_true",
        help="time the default configuration only (and the cast that opens a step)",
    )
    parser.add_argument(
        "--column-sums",
        action="store_true",
        help="sweep the cast that also sums columns (a bias gradient)",
    )
    parser.add_argument(
        "--configs",
        nargs="*",
        type=_config,
        default=None,
        help="time these BLOCK_MxBLOCK_NxWARPSxSPLIT configurations beside the default, "
        "instead of the sweep's (--default-only then has no effect)",
    )
    args = parser.parse_args()
    tokens, k, n = map(int, args.shape.split("x"))
    if not args.sweep_only:
        profile_step(args, tokens, k, n)
    sweep(args, *(map(int, args.cast_shape.split("x")) if args.cast_shape else (tokens, k)))


def profile_step(args: argparse.Namespace, tokens: int, k: int, n: int) -> None:
    """Every CUDA kernel of three fwd+bwd steps, idle gaps, and the time per step."""
    if args.mlp:
        layer = fp8state.LayerNormMLP(k, n, params_dtype=torch.bfloat16, device="cuda")
        n = k
    else:
        layer = fp8state.Linear(k, n, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)

    step = fwd_bwd(layer, x, grad, True)  # gradients set to None after each step, as timed
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    # Every kernel: the step's GPU time beyond the GEMMs is spread over many small rows.
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / 3e3
    for e in events:
        print(
            f"{e.self_device_time_total / 3e3:8.3f} ms/step {e.count // 3:4d} calls  {e.key[:90]}"
        )
    print(f"{total:8.3f} ms/step of kernels in all")
    timeline_gaps(step)
    print(
        f"step {kernel_ms(step, _CUDA, 5, 20):.3f} ms; default cast configs "
        f"{default_config(tokens, k, False)} / {default_config(tokens, k, True)} (transpose)"
    )


def _may_wait(name: str) -> bool:
    """Whether a CUDA runtime call waits for the device (or may: device or pinned allocations)."""
    return (
        "Synchronize" in name
        or name == "cudaMemcpy"
        or name.startswith(("cudaMalloc", "cudaFree", "cudaHostAlloc"))
    )


def timeline_gaps(step, steps: int = 3) -> None:
    """Where the GPU idles within steps queued behind a long sleep kernel.

    Every step is launched while the GPU still sleeps, so an idle gap between two kernels
    can only come from the device waiting (a host synchronization inside the step, a
    blocking allocation) or from the host falling behind: the largest gaps are printed with
    the kernels around them, and the host calls that can block.
    """
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        torch.cuda._sleep(200_000_000)
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    gpu = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
        key=lambda e: e["ts"],
    )[1:]  # the sleep kernel first
    gaps = [
        (b["ts"] - a["ts"] - a["dur"], a["name"], b["name"])
        for a, b in zip(gpu, gpu[1:], strict=False)
    ]
    busy = sum(e["dur"] for e in gpu)
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    print(
        f"queued steps: {span / steps / 1e3:.3f} ms/step on the GPU, {busy / steps / 1e3:.3f} "
        f"busy, {(span - busy) / steps / 1e3:.3f} idle"
    )
    for gap, before, after in sorted(gaps, reverse=True)[:8]:
        print(f"  idle {gap:7.1f} us between {before[:50]} and {after[:50]}")
    print("the last step's kernels in order:")
    for e in gpu[len(gpu) - len(gpu) // steps :]:
        grid = e.get("args", {}).get("grid")
        print(f"  {e['dur']:8.1f} us  {e['name'][:60]}  grid {grid}")
    waits: dict[str, int] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and _may_wait(e["name"]):
            waits[e["name"]] = waits.get(e["name"], 0) + 1
    print(
        f"host calls that can wait, in the region (its closing synchronize included): "
        f"{waits or 'none'}"
    )


def sweep(args: argparse.Namespace, m: int, n: int) -> None:
    """GB/s of the cast kernel per block configuration, with and without the transpose.

    The default configuration is timed too, marked ``(default)``, and as the first record of a
    step, whose launch also shifts the history down.
    """
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    aux = torch.randn_like(x) if args.op == "dgelu" else None
    cell = torch.zeros(1, device="cuda")
    for transpose in (False, True):
        moved = x.numel() * (2 + (2 if aux is not None else 0) + (2 if transpose else 1))
        results = []
        default = default_config(m, n, transpose, args.op, args.column_sums)
        swept = [] if args.default_only else CONFIGS[transpose, args.column_sums]
        if args.configs is not None:
            swept = args.configs
        for cfg in [default, *swept]:
            ms = _cast_ms(x, aux, transpose, args, cell, 1, new_step=False, config=cfg)
            results.append((ms, cfg))
        ranked = sorted(results[1:])[:8]
        opening = _opening_step_us(x, aux, transpose, args)
        for ms, cfg in [(results[0][0], f"{default} (default)"), *ranked]:
            print(
                f"cast {args.op} {m}x{n} transpose={transpose} "
                f"column_sums={args.column_sums} config={cfg}: "
                f"{ms * 1e3:.1f} us, "
                f"{moved / ms / 1e6:.0f} GB/s"
            )
        print(
            f"cast {args.op} {m}x{n} transpose={transpose} default config, first record of a "
            f"step (history {_HISTORY[0]}x{_HISTORY[1]} shifted): {opening[0]:.1f} us; "
            f"a later record: {opening[1]:.1f} us"
        )


# The history a first record shifts: TE's default length, LayerNormMLP's forward slots.
_HISTORY = (1024, 6)


def _opening_step_us(
    x: torch.Tensor, aux: torch.Tensor | None, transpose: bool, args: argparse.Namespace
) -> tuple[float, float]:
    """Microseconds of the default cast that opens a step (shifting the history) and of one
    that only records into it, on a history of ``_HISTORY``."""
    history = torch.zeros(_HISTORY, device="cuda")
    times = [
        _cast_ms(x, aux, transpose, args, history, _HISTORY[1], new_step=new_step) * 1e3
        for new_step in (True, False)
    ]
    return times[0], times[1]


def _cast_ms(
    x: torch.Tensor,
    aux: torch.Tensor | None,
    transpose: bool,
    args: argparse.Namespace,
    history: torch.Tensor,
    n_slots: int,
    *,
    new_step: bool,
    config: tuple[int, int, int, int] | None = None,
) -> float:
    """Device milliseconds of one cast into slot ``n_slots - 1`` of ``history`` (scale 1)."""
    scale = torch.ones(n_slots, device="cuda")
    return kernel_ms(
        lambda: cast_launch._launch(
            x,
            scale,
            scale,
            history,
            n_slots - 1,
            n_slots,
            torch.float8_e4m3fn,
            transpose,
            snapshot=False,
            new_step=new_step,
            column_sums=args.column_sums,
            op=args.op,
            aux=aux,
            config=config,
        ),
        _CUDA,
        5,
        20,
    )


if __name__ == "__main__":
    main()
