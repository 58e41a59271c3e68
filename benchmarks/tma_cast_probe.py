"""Casts and byte transposes through Hopper's tensor-copy engine (TMA) against fp8state's.

Usage (CUDA, compute capability 9.0): ``python benchmarks/tma_cast_probe.py [--out
benchmarks/results/h200.json]``.

fp8state's transposed casts move 3.0-3.1 TB/s at the model's large shapes, under PyTorch's
copy of the same bytes (docs/benchmarks.md). Tiles loaded and stored by the tensor-copy
engine (Triton's tensor descriptors: ``desc.load``, ``desc.store``) are the usual remedy for
a memory-bound tiled kernel on Hopper. This times, at the 16-layer model's 2048-row and
8192-row shapes (bf16 in, E4M3 out, :func:`hopper.kernel_ms`): fp8state's default cast with
the transposed copy (a later record of a step, as ``model_casts.py`` times it) and one that
opens a step (it shifts a 1024-row history first); a cast through descriptors that writes
the same two layouts and the amax (nothing else of fp8state's: a bound for the design), at
its best of a grid of tiles, warps, persistent-grid sizes and pipeline depths; fp8state's
byte transpose against one through descriptors; and a bf16 copy (the bytes of a cast with
its transposed copy) and ``Tensor.to`` (one layout, no amax). Key ``tma_cast_probe``.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
from hopper import kernel_ms, spin_up  # benchmarks/ is on sys.path as a script
from model_casts import cast_us
from record import report
from triton.tools.tensor_descriptor import TensorDescriptor

from fp8state._kernels.triton_transpose import transpose_bytes

_CUDA = torch.device("cuda")
SHAPES = [(2048, 2048), (6144, 2048), (8192, 2048), (2048, 8192), (8192, 8192)]
# (BLOCK_M, BLOCK_N) x warps x programs per multiprocessor (0: one per tile) x stages.
CAST_GRID = list(
    itertools.product(
        [(64, 128), (128, 64), (128, 128), (64, 256), (32, 128), (64, 64)],
        (4, 8),
        (0, 1, 2, 4),
        (2, 3),
    )
)
TRANSPOSE_GRID = list(
    itertools.product(
        [(64, 64), (128, 128), (64, 128), (128, 64), (128, 256), (256, 128)], (4, 8), (0, 2), (3,)
    )
)


@triton.jit
def _descriptor_cast(
    x_desc,
    o_desc,
    t_desc,
    amax_ptr,
    M,
    N,
    scale,
    BM: tl.constexpr,
    BN: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Tiles walked by a (possibly persistent) grid; both FP8 layouts stored by descriptors."""
    tiles_n = tl.cdiv(N, BN)
    running = tl.zeros((BM, BN), dtype=tl.float32)
    for t in tl.range(
        tl.program_id(0), tl.cdiv(M, BM) * tiles_n, tl.num_programs(0), num_stages=STAGES
    ):
        tm, tn = t // tiles_n, t % tiles_n
        x = x_desc.load([tm * BM, tn * BN]).to(tl.float32)
        running = tl.maximum(running, tl.abs(x))
        y = (x * scale).to(o_desc.dtype)
        o_desc.store([tm * BM, tn * BN], y)
        t_desc.store([tn * BN, tm * BM], tl.trans(y))
    tl.atomic_max(amax_ptr, tl.max(tl.max(running, axis=1), axis=0))


@triton.jit
def _descriptor_transpose(
    x_desc, t_desc, M, N, BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr
):
    tiles_n = tl.cdiv(N, BN)
    for t in tl.range(
        tl.program_id(0), tl.cdiv(M, BM) * tiles_n, tl.num_programs(0), num_stages=STAGES
    ):
        tm, tn = t // tiles_n, t % tiles_n
        t_desc.store([tn * BN, tm * BM], tl.trans(x_desc.load([tm * BM, tn * BN])))


def _grid(m: int, n: int, block: tuple[int, int], per_sm: int) -> tuple[int]:
    tiles = triton.cdiv(m, block[0]) * triton.cdiv(n, block[1])
    if not per_sm:
        return (tiles,)
    return (min(tiles, per_sm * torch.cuda.get_device_properties(_CUDA).multi_processor_count),)


def descriptor_cast(x: torch.Tensor, config: tuple) -> Callable[[], None]:
    """A launch of the descriptor cast of ``x`` (E4M3 and its transpose, amax)."""
    (bm, bn), warps, per_sm, stages = config
    m, n = x.shape
    out = torch.empty(m, n, device=x.device, dtype=torch.float8_e4m3fn)
    out_t = torch.empty(n, m, device=x.device, dtype=torch.float8_e4m3fn)
    amax = torch.zeros(1, device=x.device)
    descs = [
        TensorDescriptor.from_tensor(t, b)
        for t, b in ((x, [bm, bn]), (out, [bm, bn]), (out_t, [bn, bm]))
    ]
    launch = _descriptor_cast[_grid(m, n, (bm, bn), per_sm)]
    return lambda: launch(*descs, amax, m, n, 1.0, bm, bn, stages, num_warps=warps)


def descriptor_transpose(x8: torch.Tensor, config: tuple) -> Callable[[], None]:
    """A launch of the descriptor transpose of the byte tensor ``x8``."""
    (bm, bn), warps, per_sm, stages = config
    m, n = x8.shape
    out_t = torch.empty(n, m, device=x8.device, dtype=x8.dtype)
    descs = [
        TensorDescriptor.from_tensor(x8, [bm, bn]),
        TensorDescriptor.from_tensor(out_t, [bn, bm]),
    ]
    launch = _descriptor_transpose[_grid(m, n, (bm, bn), per_sm)]
    return lambda: launch(*descs, m, n, bm, bn, stages, num_warps=warps)


def _best_of_three(measure: Callable[[], float]) -> float:
    return round(min(measure() for _ in range(3)), 2)


def _us(fn: Callable[[], object]) -> float:
    return _best_of_three(lambda: 1e3 * kernel_ms(fn, _CUDA, 5, 40))


def _best(make: Callable[[tuple], Callable[[], None]], grid: list) -> dict:
    """The fastest configuration of ``grid`` (configurations Triton rejects are skipped)."""
    timed = []
    for config in grid:
        try:
            timed.append((_us(make(config)), config))
        except Exception:  # noqa: BLE001 - e.g. a tile too large for shared memory
            continue
    micros, config = min(timed)
    return {"us": micros, "config": repr(config)}


def shape_row(m: int, n: int) -> dict:
    x = torch.randn(m, n, device=_CUDA, dtype=torch.bfloat16)
    x8 = x.to(torch.float8_e4m3fn)

    def fp8state_cast(new_step: bool) -> float:
        return _best_of_three(lambda: cast_us(x, None, "identity", True, False, 40, new_step))

    return {
        "fp8state_cast_us": fp8state_cast(False),
        "fp8state_opening_cast_us": fp8state_cast(True),
        "descriptor_cast": _best(lambda c: descriptor_cast(x, c), CAST_GRID),
        "fp8state_byte_transpose_us": _us(lambda: transpose_bytes(x8)),
        "descriptor_transpose": _best(lambda c: descriptor_transpose(x8, c), TRANSPOSE_GRID),
        "bf16_copy_us": _us(x.clone),
        "to_fp8_us": _us(lambda: x.to(torch.float8_e4m3fn)),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    spin_up(_CUDA, 3)
    result: dict = {f"{m}x{n}": shape_row(m, n) for m, n in SHAPES}
    result["command"] = "python benchmarks/tma_cast_probe.py"
    out = {"tma_cast_probe": result}
    report(out, args.out)
    return out


if __name__ == "__main__":
    main()
