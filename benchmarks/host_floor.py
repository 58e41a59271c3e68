"""The least host time any eager FP8 Linear step with delayed scaling can take.

An FP8 ``Linear`` fwd+bwd must, at the very least, launch three casts (input and weight in
forward, the output gradient in backward), three scaled GEMMs (``torch._scaled_mm``) and
one scale update per direction, from inside one ``torch.autograd.Function``.
:func:`floor_step` does exactly that and nothing else: one cheapest launch per cast
(``Tensor.to``, without an amax), the GEMMs on operands laid out beforehand (no transpose
work), one in-place op per update, no bookkeeping. Its host time over ``nn.Linear``'s bounds
from below what fp8state's eager path can reach: ``python benchmarks/training_loop.py``
records it as ``host_floor_ratio`` next to ``host_overhead_ratio``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class _Floor(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, ops: dict) -> torch.Tensor:  # type: ignore[override]
        x.to(E4M3)  # the input's cast
        w.to(E4M3)  # the weight's cast
        ctx.ops = ops
        s = ops["scale"]
        return torch._scaled_mm(ops["x8"], ops["w8_t"], s, s, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        ops = ctx.ops
        s = ops["scale"]
        grad.to(E5M2)  # the output gradient's cast
        dx = torch._scaled_mm(ops["g8"], ops["w8"], s, s, out_dtype=grad.dtype)
        dw = torch._scaled_mm(ops["g8_t"], ops["x8_cm"], s, s, out_dtype=grad.dtype)
        ops["bwd_scale"].mul_(1.0)  # the backward scale update
        return dx, dw, None


def floor_step(tokens: int, k: int, n: int) -> Callable[[], None]:
    """One minimal FP8 fwd+bwd of a ``tokens x k -> n`` Linear on CUDA (bf16 in and out)."""
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(tokens, k, device=dev, dtype=bf16, requires_grad=True)
    w = torch.randn(n, k, device=dev, dtype=bf16, requires_grad=True)
    grad = torch.randn(tokens, n, device=dev, dtype=bf16)
    ops = {
        "scale": torch.ones((), device=dev),
        "bwd_scale": torch.ones(2, device=dev),
        "x8": x.detach().to(E4M3),  # (M, K) row-major
        "w8_t": w.detach().to(E4M3).t(),  # (K, N) column-major
        "g8": grad.to(E5M2),  # (M, N) row-major
        "w8": w.detach().t().contiguous().to(E4M3).t(),  # (N, K) column-major
        "g8_t": grad.t().contiguous().to(E5M2),  # (N, M) row-major
        "x8_cm": x.detach().to(E4M3),  # (M, K) row-major read as column-major (K, M).T
    }
    ops["x8_cm"] = ops["x8_cm"].t().contiguous().t()
    fwd_scale = torch.ones(3, device=dev)

    def step() -> None:
        y = _Floor.apply(x, w, ops)
        fwd_scale.mul_(1.0)  # the forward scale update, when the forward context exits
        y.backward(grad)

    return step
