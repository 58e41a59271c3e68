"""The least an FP8 Linear step with delayed scaling can launch: host time and model floors.

An FP8 ``Linear`` fwd+bwd must, at the very least, launch three casts (input and weight in
forward, the output gradient in backward), three scaled GEMMs (``torch._scaled_mm``) and
one scale update per direction, from inside one ``torch.autograd.Function``.
:func:`floor_step` does exactly that and nothing else: one cheapest launch per cast
(``Tensor.to``, without an amax), no transpose work (the GEMMs' transposed operands are laid
out beforehand), one in-place op per update, no bookkeeping. Its host time over
``nn.Linear``'s bounds from below what fp8state's eager path can reach: ``python
benchmarks/training_loop.py`` records it as ``host_floor_ratio`` next to
``host_overhead_ratio``, and its step time per sweep shape as ``sweep_floor``.

The casts' outputs feed the GEMMs wherever their layout serves (the input and the output
gradient as row operands, the weight as the forward's column operand), so a compiler cannot
drop them as unused work: :class:`FloorLinear` bounds compiled models too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class _Floor(torch.autograd.Function):
    """``x @ w.T`` from the least casting; the transposed operands come laid out beforehand.

    ``x8``: the input already in FP8 (a LayerNorm or GELU fused with its cast wrote it), or
    None to cast it here. ``laid_out``: the scale, backward's transposed operands (``w8``,
    ``g8_t``, ``x8_cm``) and the tensor updated at the end of backward (one module stepping
    alone) or None.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        x8: torch.Tensor | None,
        laid_out: tuple[torch.Tensor | None, ...],
    ) -> torch.Tensor:
        if x8 is None:
            x8 = x.reshape(-1, x.shape[-1]).to(E4M3)  # the input's cast: (M, K) row-major
        w8_t = w.to(E4M3).t()  # the weight's cast: (N, K) row-major is (K, N) column-major
        # An attribute, not saved tensors: none of them takes part in autograd, and saving
        # and unpacking them is host work the least step does without.
        ctx.laid_out = laid_out
        scale = laid_out[0]
        out = torch._scaled_mm(  # fast accumulation in forward, as fp8state's
            x8, w8_t, scale, scale, out_dtype=x.dtype, use_fast_accum=True
        )
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        scale, w8, g8_t, x8_cm, bwd_scale = ctx.laid_out
        g8 = grad.reshape(-1, grad.shape[-1]).to(E5M2)  # the output gradient's cast
        dx = torch._scaled_mm(g8, w8, scale, scale, out_dtype=grad.dtype)
        dw = torch._scaled_mm(g8_t, x8_cm, scale, scale, out_dtype=grad.dtype)
        if bwd_scale is not None:
            bwd_scale.mul_(1.0)
        return dx.view(*grad.shape[:-1], dx.shape[-1]), dw, None, None


def _operands(
    tokens: int, k: int, n: int, device: torch.device, fused_input: bool = False
) -> dict[str, torch.Tensor | None]:
    """The operands laid out beforehand: backward's transposed ones, and the input where
    ``fused_input`` (else None: the layer casts it)."""
    bf16 = torch.bfloat16
    x8 = torch.randn(tokens, k, device=device, dtype=bf16).to(E4M3)  # (M, K) row-major
    w = torch.randn(n, k, device=device, dtype=bf16)
    grad = torch.randn(tokens, n, device=device, dtype=bf16)
    return {
        "scale": torch.ones((), device=device),
        "x8": x8 if fused_input else None,
        "w8": w.t().contiguous().to(E4M3).t(),  # (N, K) column-major
        "g8_t": grad.t().contiguous().to(E5M2),  # (N, M) row-major
        "x8_cm": x8.t().contiguous().t(),  # (M, K) read as column-major (K, M).T
    }


def floor_step(
    tokens: int, k: int, n: int, device: torch.device | str = "cuda"
) -> Callable[[], None]:
    """One minimal FP8 fwd+bwd of a ``tokens x k -> n`` Linear (bf16 in and out)."""
    bf16 = torch.bfloat16
    x = torch.randn(tokens, k, device=device, dtype=bf16, requires_grad=True)
    w = torch.randn(n, k, device=device, dtype=bf16, requires_grad=True)
    grad = torch.randn(tokens, n, device=device, dtype=bf16)
    ops = _operands(tokens, k, n, torch.device(device))
    bwd_scale, fwd_scale = torch.ones(2, device=device), torch.ones(3, device=device)
    laid_out = (ops["scale"], ops["w8"], ops["g8_t"], ops["x8_cm"], bwd_scale)

    def step() -> None:
        y = _Floor.apply(x, w, None, laid_out)
        fwd_scale.mul_(1.0)  # the forward scale update, when the forward context exits
        y.backward(grad)

    return step


class FloorLinear(nn.Module):
    """The floor's FP8 GEMM as a layer of a model: ``tokens`` rows in, ``n`` features out.

    Backward's transposed operands are buffers laid out beforehand, so the weight gradient
    does not depend on the input: the layer measures the launches of a model's FP8 step, not
    its numbers. The scale updates are the model step's (:func:`floor_model_step`), one per
    direction per step. ``fused_input``: the kernel that made the input also cast it (a
    LayerNorm or GELU fused with the cast), so the layer launches no cast of its own for it.
    """

    def __init__(
        self,
        tokens: int,
        k: int,
        n: int,
        fused_input: bool = False,
        device: torch.device | str = "cuda",
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.weight = nn.Parameter(torch.randn(n, k, device=device, dtype=torch.bfloat16))
        for name, tensor in _operands(tokens, k, n, device, fused_input).items():
            self.register_buffer(name, tensor, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        laid_out = (self.scale, self.w8, self.g8_t, self.x8_cm, None)
        return _Floor.apply(x, self.weight, self.x8, laid_out)


def floor_model_step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """A fwd+bwd of ``model`` (built of :class:`FloorLinear`) with one update per direction."""
    fwd_scale, bwd_scale = torch.ones(3, device=x.device), torch.ones(3, device=x.device)

    def step() -> None:
        y = model(x)
        fwd_scale.mul_(1.0)  # the step's forward scale update
        y.backward(grad)
        bwd_scale.mul_(1.0)  # the step's backward scale update

    return step
