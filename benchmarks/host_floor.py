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
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class _Floor(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, ops: dict) -> torch.Tensor:  # type: ignore[override]
        if not ops.get("fused_input"):  # else the kernel before wrote FP8 (LayerNorm, GELU)
            x.to(E4M3)  # the input's cast
        w.to(E4M3)  # the weight's cast
        ctx.ops = ops
        s = ops["scale"]
        out = torch._scaled_mm(  # fast accumulation in forward, as fp8state's
            ops["x8"], ops["w8_t"], s, s, out_dtype=x.dtype, use_fast_accum=True
        )
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        ops = ctx.ops
        s = ops["scale"]
        grad.to(E5M2)  # the output gradient's cast
        dx = torch._scaled_mm(ops["g8"], ops["w8"], s, s, out_dtype=grad.dtype)
        dw = torch._scaled_mm(ops["g8_t"], ops["x8_cm"], s, s, out_dtype=grad.dtype)
        if "bwd_scale" in ops:  # one module stepping alone updates its own scales
            ops["bwd_scale"].mul_(1.0)
        return dx.view(*grad.shape[:-1], dx.shape[-1]), dw, None


def _operands(tokens: int, k: int, n: int, dev: str) -> dict[str, torch.Tensor]:
    """Every operand the floor's GEMMs read, cast and laid out beforehand."""
    bf16 = torch.bfloat16
    x = torch.randn(tokens, k, device=dev, dtype=bf16)
    w = torch.randn(n, k, device=dev, dtype=bf16)
    grad = torch.randn(tokens, n, device=dev, dtype=bf16)
    return {
        "scale": torch.ones((), device=dev),
        "x8": x.to(E4M3),  # (M, K) row-major
        "w8_t": w.to(E4M3).t(),  # (K, N) column-major
        "g8": grad.to(E5M2),  # (M, N) row-major
        "w8": w.t().contiguous().to(E4M3).t(),  # (N, K) column-major
        "g8_t": grad.t().contiguous().to(E5M2),  # (N, M) row-major
        "x8_cm": x.to(E4M3).t().contiguous().t(),  # (M, K) read as column-major (K, M).T
    }


def floor_step(tokens: int, k: int, n: int) -> Callable[[], None]:
    """One minimal FP8 fwd+bwd of a ``tokens x k -> n`` Linear on CUDA (bf16 in and out)."""
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(tokens, k, device=dev, dtype=bf16, requires_grad=True)
    w = torch.randn(n, k, device=dev, dtype=bf16, requires_grad=True)
    grad = torch.randn(tokens, n, device=dev, dtype=bf16)
    ops = {**_operands(tokens, k, n, dev), "bwd_scale": torch.ones(2, device=dev)}
    fwd_scale = torch.ones(3, device=dev)

    def step() -> None:
        y = _Floor.apply(x, w, ops)
        fwd_scale.mul_(1.0)  # the forward scale update, when the forward context exits
        y.backward(grad)

    return step


class FloorLinear(nn.Module):
    """The floor's FP8 GEMM as a layer of a model: ``tokens`` rows in, ``n`` features out.

    Its GEMMs read operands cast beforehand, so the layer's output does not depend on its
    input: it measures the launches of a model's FP8 step, not its numbers. The scale
    updates are the model step's (:func:`floor_model_step`), one per direction per step.
    ``fused_input``: the kernel that made the input also cast it (a LayerNorm or GELU fused
    with the cast), so the layer launches no cast of its own for it.
    """

    def __init__(self, tokens: int, k: int, n: int, fused_input: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        self.ops = {**_operands(tokens, k, n, "cuda"), "fused_input": fused_input}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Floor.apply(x, self.weight, self.ops)


def floor_model_step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """A fwd+bwd of ``model`` (built of :class:`FloorLinear`) with one update per direction."""
    fwd_scale, bwd_scale = torch.ones(3, device="cuda"), torch.ones(3, device="cuda")

    def step() -> None:
        y = model(x)
        fwd_scale.mul_(1.0)  # the step's forward scale update
        y.backward(grad)
        bwd_scale.mul_(1.0)  # the step's backward scale update

    return step
