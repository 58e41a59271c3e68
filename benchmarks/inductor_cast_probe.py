"""FP8 casts as Triton kernels inside Inductor's graphs: what compiles, and what it saves the host.

Usage (CUDA): ``python benchmarks/inductor_cast_probe.py [--layers 8] [--features 2048]
[--tokens 2048]``, or ``--constructs``.

fp8state's compiled steps call their fused casts from custom operators, whose Python runs at
every call (docs/compile.md). A cast that Inductor launched itself, as a kernel handed to it
with ``torch.library.triton_op`` and ``wrap_triton``, would skip that Python. This probe
measures both sides of that design with a minimal cast kernel (scale, saturate, FP8 copy and
its transpose, the amax max-combined atomically into a history buffer the operator declares
it mutates):

- ``--constructs``: which parts of such a kernel Inductor compiles. Six variants of it, each
  run eagerly and inside a compiled function: everything; without the FP8 conversion
  (bf16 output); without the transposed copy; without the atomic amax; with the FP8 bound a
  literal instead of a ``float`` argument; none of these.
- default: host and synchronized milliseconds per fwd+bwd step of ``--layers`` square
  layers at ``--tokens`` x ``--features``, compiled in Inductor's default mode, launched back
  to back (best of five blocks of ten steps): ``nn.Linear`` in bf16; a delayed-scaling FP8
  linear whose three casts are the kernel above and whose GEMMs are ``torch._scaled_mm``,
  with no other bookkeeping (no history shift, no scale update: a bound on what such a design
  costs the host); and fp8state's ``Linear`` with every GEMM in FP8, as compiled today.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import torch
import triton
import triton.language as tl
from profile_step import timed_ms  # benchmarks/ is on sys.path as a script
from torch import nn
from torch.library import triton_op, wrap_triton
from training_loop import guarded
from transformer import make_step

import fp8state

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCK = 64


@triton.jit
def _cast_amax(
    x_ptr, out_ptr, out_t_ptr, scale_ptr, hist_ptr, slot, M, N, fp8_max,
    BLOCK: tl.constexpr, FP8: tl.constexpr, TRANSPOSE: tl.constexpr, AMAX: tl.constexpr,
    BOUND_ARG: tl.constexpr, E5M2: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if BOUND_ARG:
        bound = fp8_max
    else:
        bound = 57344.0 if E5M2 else 448.0
    y = tl.minimum(tl.maximum(x * tl.load(scale_ptr + slot), -bound), bound)
    if FP8:
        y = y.to(out_ptr.dtype.element_ty)
    else:
        y = y.to(tl.bfloat16)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], y, mask=mask)
    if TRANSPOSE:
        tl.store(out_t_ptr + cols[None, :] * M + rows[:, None], y, mask=mask)
    if AMAX:
        amax = tl.max(tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1), axis=0)
        tl.atomic_max(hist_ptr + slot, amax)


def _define(name: str, fp8: bool, transpose: bool, amax: bool, bound_arg: bool) -> Any:
    """``fp8state_probe::name(x, scale, hist, slot, e5m2) -> (copy, transposed copy)``."""

    @triton_op(f"fp8state_probe::{name}", mutates_args={"hist"})
    def cast(
        x: torch.Tensor, scale: torch.Tensor, hist: torch.Tensor, slot: int, e5m2: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m, n = x.shape
        dtype = (E5M2 if e5m2 else E4M3) if fp8 else torch.bfloat16
        out = torch.empty((m, n), dtype=dtype, device=x.device)
        out_t = torch.empty((n, m), dtype=dtype, device=x.device)
        wrap_triton(_cast_amax)[(triton.cdiv(m, BLOCK), triton.cdiv(n, BLOCK))](
            x, out, out_t, scale, hist, slot, m, n, 57344.0 if e5m2 else 448.0,
            BLOCK=BLOCK, FP8=fp8, TRANSPOSE=transpose, AMAX=amax, BOUND_ARG=bound_arg,
            E5M2=e5m2,
        )  # fmt: skip
        return out, out_t

    return cast


def _ran(run: Any) -> str:
    """``ok`` once ``run()`` and the GPU's work are done."""
    run()
    torch.cuda.synchronize()
    return "ok"


def constructs() -> None:
    """Each variant of the kernel, eagerly and compiled: ``ok`` or the error's first line."""
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    variants = {  # fp8, transpose, amax, bound as an argument
        "everything": (True, True, True, True),
        "no FP8 conversion": (False, True, True, True),
        "no transposed copy": (True, False, True, True),
        "no atomic amax": (True, True, False, True),
        "FP8 bound a literal": (True, True, True, False),
        "none of these": (False, False, False, False),
    }
    for i, (label, flags) in enumerate(variants.items()):
        eager, compiled = _both(_define(f"variant_{i}", *flags), x)
        print(f"{label}: eager {eager} | compiled {compiled}", flush=True)


def _both(cast: Any, x: torch.Tensor) -> tuple[str, str]:
    """The outcomes of ``cast`` run eagerly, then inside a compiled function."""
    scale, hist = torch.ones(2, device="cuda"), torch.zeros(2, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(lambda a: cast(a * 2, scale, hist, 0, False))
    # guarded: "ok", or the error's type and first line (its traceback printed).
    eager = guarded(lambda: _ran(lambda: cast(x, scale, hist, 0, False)))
    return eager, guarded(lambda: _ran(lambda: compiled(x)))


_CAST = _define("cast", True, True, True, False)  # the variant Inductor compiles


class _ProbeLinear(torch.autograd.Function):
    """``x @ w.T`` in FP8: three casts by the kernel, three ``torch._scaled_mm``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, *meta: torch.Tensor) -> torch.Tensor:
        scale_f, hist_f, inv_f, scale_b, hist_b, inv_b = meta
        x8, x8_t = _CAST(x, scale_f, hist_f, 0, False)
        w8, w8_t = _CAST(w, scale_f, hist_f, 1, False)
        # 16 bytes apart: cuBLAS refuses a scale at an address that is not aligned.
        x_inv, w_inv = inv_f[0:1], inv_f[4:5]
        out = torch._scaled_mm(x8, w8.t(), x_inv, w_inv, out_dtype=x.dtype, use_fast_accum=True)
        ctx.save_for_backward(x8_t, w8_t, x_inv, w_inv, scale_b, hist_b, inv_b)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x8_t, w8_t, x_inv, w_inv, scale_b, hist_b, inv_b = ctx.saved_tensors
        g8, g8_t = _CAST(grad.contiguous(), scale_b, hist_b, 0, True)
        g_inv = inv_b[0:1]
        dx = torch._scaled_mm(g8, w8_t.t(), g_inv, w_inv, out_dtype=grad.dtype)
        dw = torch._scaled_mm(g8_t, x8_t.t(), g_inv, x_inv, out_dtype=grad.dtype)
        return (dx, dw, *[None] * 6)


class ProbeLinear(nn.Module):
    """A square FP8 layer of :class:`_ProbeLinear`, its metadata as buffers."""

    def __init__(self, features: int) -> None:
        super().__init__()
        weight = torch.randn(features, features, device="cuda", dtype=torch.bfloat16)
        self.weight = nn.Parameter(weight / features**0.5)
        for d in ("fwd", "bwd"):
            self.register_buffer(f"scale_{d}", torch.ones(2, device="cuda"))
            self.register_buffer(f"hist_{d}", torch.zeros(16, 2, device="cuda"))
            self.register_buffer(f"inv_{d}", torch.ones(8, device="cuda"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        meta = (self.scale_fwd, self.hist_fwd, self.inv_fwd)
        return _ProbeLinear.apply(
            x, self.weight, *meta, self.scale_bwd, self.hist_bwd, self.inv_bwd
        )


def _stack(kind: str, layers: int, features: int) -> nn.Module:
    kw: dict[str, Any] = {"device": "cuda"}
    if kind == "bf16":
        return nn.Sequential(
            *[nn.Linear(features, features, bias=False, dtype=torch.bfloat16, **kw)
              for _ in range(layers)]
        )  # fmt: skip
    if kind == "fp8state":
        modules = [
            fp8state.Linear(features, features, bias=False, params_dtype=torch.bfloat16, **kw)
            for _ in range(layers)
        ]
        for module in modules:
            module.fp8_min_gemm_macs = 0  # every GEMM in FP8
        return nn.Sequential(*modules)
    return nn.Sequential(*[ProbeLinear(features) for _ in range(layers)])


def _measure(step: Any, start: float) -> str:
    """Host and synchronized ms per ``step`` after three warm-ups (the compilation's)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    device = torch.device("cuda")
    hosts, walls = zip(*(timed_ms(step, device, 10) for _ in range(5)), strict=True)
    return (
        f"host {min(hosts):.2f} ms/step, synchronized {min(walls):.2f} ms/step "
        f"(compiled in {compile_s:.0f} s)"
    )


def steps(layers: int, features: int, tokens: int) -> None:
    """Host and synchronized ms per compiled step of each stack (best of five blocks of ten)."""
    x = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    for kind in ("bf16", "triton_op casts", "fp8state"):
        start = time.perf_counter()
        model = torch.compile(_stack(kind, layers, features))
        step = make_step(model, x, grad, kind == "fp8state")
        result = guarded(functools.partial(_measure, step, start))
        print(f"{kind} ({layers} layers, {tokens}x{features}x{features}): {result}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--constructs", action="store_true", help="what Inductor compiles")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--features", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("inductor_cast_probe.py needs a CUDA device (Triton kernels).")
    if args.constructs:
        constructs()
    else:
        steps(args.layers, args.features, args.tokens)


if __name__ == "__main__":
    main()
