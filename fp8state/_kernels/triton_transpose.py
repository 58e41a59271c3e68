"""The contiguous transpose of a 2-D one-byte (FP8) CUDA tensor, in one launch.

LayerNormMLP transposes GELU's FP8 output and its FP8 gradient with it, after their casts
(see :mod:`fp8state.functional.mlp`). PyTorch's generic strided copy moves one-byte elements well
below the copy bandwidth; square tiles read and written whole do better.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8state._kernels.launch import FastLauncher, int_spec, ptr_aligned

__all__ = ["transpose_bytes"]


@triton.jit
def _transpose_kernel(src, dst, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(src + r[:, None].to(tl.int64) * cols + c[None, :], mask=mask)
    # dst[c, r] = src[r, c]: write the tile transposed, rows of dst contiguous.
    tl.store(dst + c[None, :].to(tl.int64) * rows + r[:, None], tile, mask=mask)


# Launched per LayerNormMLP step twice: the fast launcher, as the casts (launch.py says why).
_LAUNCHER = FastLauncher(_transpose_kernel)


def transpose_bytes(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``x.t().contiguous()`` for a contiguous 2-D CUDA tensor of a one-byte dtype."""
    rows, cols = x.shape
    raw = x.view(torch.uint8)
    out = torch.empty((cols, rows), dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(rows, block), triton.cdiv(cols, block))
    key = (block, int_spec(rows), int_spec(cols), ptr_aligned(raw), ptr_aligned(out))
    _LAUNCHER(key, grid, (raw, out, rows, cols, block, block), x.device, num_warps=8)
    return out.view(x.dtype)
