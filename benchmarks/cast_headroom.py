"""How much faster a cast with a transposed copy can run than fp8state's, shape by shape.

Usage (CUDA + Triton): ``python benchmarks/cast_headroom.py``.

Times, back to back (:func:`hopper.kernel_ms`), for bf16 tensors of the 16-layer model's
shapes: fp8state's cast with the transposed copy (its default block shapes), a minimal
Triton kernel that writes the same two FP8 layouts and an amax but nothing else fp8state's
does (no masks, no NaN kept through the saturation, no infinities left out of the amax, no
history, snapshot or step bookkeeping), the same kernel with each of those semantics added
back (at the minimal kernel's best block shape), ``Tensor.to(float8_e4m3fn)`` (one layout,
no amax) and a bf16 copy. What each semantics costs says where a faster formulation of
fp8state's cast would come from; the copy says what the memory moves at.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from hopper import kernel_ms, spin_up  # benchmarks/ is on sys.path as a script
from model_casts import cast_us

_CUDA = torch.device("cuda")
SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192), (8192, 8192)]
# (BLOCK_M, BLOCK_N, num_warps, column tiles per program) of the minimal kernel.
BLOCKS = [(64, 128, 4, 1), (64, 128, 4, 2), (64, 128, 8, 2), (32, 128, 4, 2), (128, 64, 4, 2)]


@triton.jit
def _minimal_cast(
    x_ptr,
    out_ptr,
    out_t_ptr,
    amax_ptr,
    M,
    N,
    scale,
    BM: tl.constexpr,
    BN: tl.constexpr,
    TILES: tl.constexpr,
    MASK: tl.constexpr = False,
    NAN: tl.constexpr = 0,
    FINITE: tl.constexpr = False,
):
    """The minimal cast; ``MASK``, ``NAN`` and ``FINITE`` add one of fp8state's semantics each.

    ``MASK``: loads and stores masked at the tensor's edges. ``NAN``: NaN kept through the
    saturation, 1 as fp8state's kernel keeps it (a select), 2 with a NaN-propagating clamp.
    ``FINITE``: infinities left out of the amax (NaN is, by the hardware maximum).
    """
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    running = tl.zeros((BM, BN), dtype=tl.float32)
    for tile in tl.static_range(TILES):
        cols = (tl.program_id(1) * TILES + tile) * BN + tl.arange(0, BN)
        offsets = rows[:, None] * N + cols[None, :]
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        if MASK:
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + offsets).to(tl.float32)
        ax = tl.abs(x)
        if FINITE:
            ax = tl.where(ax < float("inf"), ax, 0.0)
        running = tl.maximum(running, ax)
        scaled = x * scale
        if NAN == 1:
            bounded = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
            y = tl.where(scaled != scaled, scaled, bounded)
        elif NAN == 2:
            y = tl.clamp(scaled, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        else:
            y = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
        y = y.to(tl.float8e4nv)
        offsets_t = cols[:, None] * M + rows[None, :]
        if MASK:
            tl.store(out_ptr + offsets, y, mask=mask)
            tl.store(out_t_ptr + offsets_t, tl.trans(y), mask=tl.trans(mask))
        else:
            tl.store(out_ptr + offsets, y)
            tl.store(out_t_ptr + offsets_t, tl.trans(y))
    tl.atomic_max(amax_ptr, tl.max(tl.max(running, axis=1), axis=0))


# fp8state's semantics, one at a time and together: (MASK, NAN, FINITE) of the minimal cast.
SEMANTICS = {
    "masks": (True, 0, False),
    "NaN kept (select)": (False, 1, False),
    "NaN kept (NaN-propagating clamp)": (False, 2, False),
    "infinities out of the amax": (False, 0, True),
    "all three (select)": (True, 1, True),
    "all three (clamp)": (True, 2, True),
}


def _us(fn) -> float:
    return 1e3 * kernel_ms(fn, _CUDA, 5, 40)


def _minimal_us(
    x: torch.Tensor,
    block: tuple[int, int, int, int],
    semantics: tuple[bool, int, bool] = (False, 0, False),
) -> float:
    m, n = x.shape
    bm, bn, warps, tiles = block
    out = torch.empty(m, n, device=_CUDA, dtype=torch.float8_e4m3fn)
    out_t = torch.empty(n, m, device=_CUDA, dtype=torch.float8_e4m3fn)
    amax = torch.zeros(1, device=_CUDA)
    launch = _minimal_cast[(m // bm, n // (bn * tiles))]
    mask, nan, finite = semantics
    return _us(
        lambda: launch(
            x, out, out_t, amax, m, n, 1.0, bm, bn, tiles, mask, nan, finite, num_warps=warps
        )
    )


def shape_rows(m: int, n: int) -> dict[str, tuple[float, int]]:
    """``{what: (microseconds, bytes moved per element)}`` for an ``m x n`` bf16 tensor."""
    x = torch.randn(m, n, device=_CUDA, dtype=torch.bfloat16)
    best, block = min((_minimal_us(x, block), block) for block in BLOCKS)
    added = {
        f"minimal cast + {name}": (_minimal_us(x, block, semantics), 4)
        for name, semantics in SEMANTICS.items()
    }
    return {
        # fp8state's default cast, as model_casts.py times it (40 launches, as the others here).
        "fp8state cast + transpose": (cast_us(x, None, "identity", True, False, iters=40), 4),
        f"minimal cast + transpose {block}": (best, 4),
        **added,
        "Tensor.to(float8_e4m3fn)": (_us(lambda: x.to(torch.float8_e4m3fn)), 3),
        "bf16 copy": (_us(x.clone), 4),
    }


def main() -> None:
    spin_up(_CUDA, 3)
    for m, n in SHAPES:
        for name, (micros, bytes_per_element) in shape_rows(m, n).items():
            rate = m * n * bytes_per_element / micros / 1e3
            print(f"{m}x{n} {name}: {micros:.1f} us, {rate:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
