"""FP8 GEMM backends: ``torch._scaled_mm`` on FP8-capable GPUs, an emulation everywhere else.

Both take the same FP8 operands and inverse scales, so the scaling math is shared and CPU tests
cover everything but the kernel. The choice is explicit: ``fp8_autocast(gemm_backend=...)``
asks for ``"auto"`` (the default), ``"emulated"`` or ``"scaled_mm"``; :func:`resolve_backend`
says what runs and why, and every FP8 module records the backend of its last GEMM in
``module.fp8_last_gemm_backend``.
"""

from __future__ import annotations

import functools

import torch

from fp8state.errors import ConfigError
from fp8state.quantize import dequantize

__all__ = [
    "BACKENDS",
    "DEFAULT_MIN_GEMM_MACS",
    "GRAPHED_MIN_GEMM_MACS",
    "scaled_mm_support",
    "resolve_backend",
    "fp8_gemm",
    "min_gemm_macs",
    "gemm_runs_as",
]

BACKENDS = ("auto", "emulated", "scaled_mm")

#: Below this many multiply-accumulates (tokens * in * out) a GEMM runs in high precision under
#: fp8_autocast, eagerly and compiled: there the host queues every launch of the step, and an
#: FP8 GEMM's casts, scale bookkeeping and three ``torch._scaled_mm`` calls cost more host time
#: than its faster kernels save until the GEMM is this large (measured on an H200,
#: docs/benchmarks.md: fwd+bwd at 2**36 ran at 0.61x bf16, at 2**37 at 0.80-1.18x, above 1
#: in four of six runs, and it keeps the MLP GEMMs of 8192-token batches in FP8). The
#: emulation exists for numerics, not speed, so it never falls back.
DEFAULT_MIN_GEMM_MACS = {"scaled_mm": 2**37, "emulated": 0}
#: The same threshold for modules whose steps replay as CUDA graphs
#: (``fp8state.make_graphed_callables``): one launch per step takes the host out, and FP8 pays
#: from where its kernels alone beat bf16's (at 2048x1024x1024, 2**31, the FP8 GEMM alone is
#: slower).
GRAPHED_MIN_GEMM_MACS = {"scaled_mm": 2**32, "emulated": 0}

# torch._scaled_mm needs the inner and output dimensions to be multiples of 16.
_SCALED_MM_ALIGN = 16


@functools.cache
def _cuda_support(index: int) -> tuple[bool, str]:
    if not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_mm"
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        return False, f"cuda:{index} has compute capability {major}.{minor} < 8.9 (no FP8 GEMM)"
    return True, f"cuda:{index} has compute capability {major}.{minor} >= 8.9"


def scaled_mm_support(device: torch.device) -> tuple[bool, str]:
    """Whether ``torch._scaled_mm`` can run on ``device``, and why (or why not)."""
    if device.type != "cuda":
        return False, f"device {device} is not a CUDA device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_support(index)


def resolve_backend(requested: str, device: torch.device) -> str:
    """The backend that runs for ``requested`` on ``device``.

    Raises:
        ConfigError: ``requested`` is unknown, or ``"scaled_mm"`` where it cannot run.
    """
    resolved = _RESOLVED.get((requested, device))
    if resolved is not None:  # this runs for every GEMM: a device's answer never changes
        return resolved
    if requested not in BACKENDS:
        raise ConfigError(
            "gemm_backend", repr(requested), f"one of {BACKENDS}", "Pass gemm_backend='auto'."
        )
    if requested == "emulated":
        return "emulated"
    ok, reason = scaled_mm_support(device)
    if requested == "scaled_mm" and not ok:
        raise ConfigError(
            "gemm_backend",
            f"'scaled_mm' requested, but {reason}",
            "a CUDA device with compute capability >= 8.9",
            "Use gemm_backend='auto' or 'emulated' on this device.",
        )
    resolved = "scaled_mm" if ok else "emulated"
    if device.type != "cuda" or device.index is not None:  # "cuda" alone: the current one
        _RESOLVED[requested, device] = resolved
    return resolved


_RESOLVED: dict[tuple[str, torch.device], str] = {}


def min_gemm_macs(backend: str, override: int | None, graphed: bool = False) -> int:
    """The fallback threshold for ``backend``: ``override`` if set, else the default.

    Args:
        backend: ``"scaled_mm"`` or ``"emulated"``.
        override: The module's ``fp8_min_gemm_macs`` (None: the default).
        graphed: The module's steps replay as CUDA graphs (``fp8_graphed``): the default is
            :data:`GRAPHED_MIN_GEMM_MACS`'s instead of :data:`DEFAULT_MIN_GEMM_MACS`'s.

    Example:
        >>> from fp8state.backends import min_gemm_macs
        >>> min_gemm_macs("scaled_mm", None) == 2**37
        True
        >>> min_gemm_macs("scaled_mm", None, graphed=True) == 2**32
        True
        >>> min_gemm_macs("scaled_mm", 0), min_gemm_macs("emulated", None)
        (0, 0)
    """
    if override is not None:
        return override
    return (GRAPHED_MIN_GEMM_MACS if graphed else DEFAULT_MIN_GEMM_MACS)[backend]


def gemm_runs_as(backend: str, inner: int, cols: int) -> str:
    """What :func:`fp8_gemm` runs for ``backend`` with inner dimension ``inner`` and ``cols``.

    ``torch._scaled_mm`` takes only multiples of 16; other shapes run the emulation.

    Example:
        >>> from fp8state.backends import gemm_runs_as
        >>> gemm_runs_as("scaled_mm", 2048, 1024), gemm_runs_as("scaled_mm", 2048, 1000)
        ('scaled_mm', 'emulated')
    """
    if backend == "scaled_mm" and (inner % _SCALED_MM_ALIGN or cols % _SCALED_MM_ALIGN):
        return "emulated"
    return backend


def fp8_gemm(
    a_fp8: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_fp8: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str,
    bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> tuple[torch.Tensor, str]:
    """``(a * a_scale_inv) @ (b * b_scale_inv) + bias`` for FP8 ``a (M, K)`` and ``b (K, N)``.

    Args:
        a_fp8: Row operand, FP8.
        a_scale_inv: Its inverse scale (0-d or 1-element float32).
        b_fp8: Column operand, FP8 (any memory layout; made column-major for the kernel).
        b_scale_inv: Its inverse scale.
        out_dtype: dtype of the result.
        backend: ``"scaled_mm"`` or ``"emulated"`` (from :func:`resolve_backend`).
        bias: Optional ``(N,)`` high-precision bias, added to the result.
        fast_accum: Let ``torch._scaled_mm`` accumulate in the tensor cores' reduced
            precision without periodic promotion; TE does so for forward GEMMs only
            (``use_split_accumulator=False`` for fprop), keeping full accumulation for the
            gradients. No effect on the emulation.

    Returns:
        The product and the backend that computed it: ``"scaled_mm"`` falls back to
        ``"emulated"`` for shapes the kernel cannot take (dimensions not multiples of 16).
    """
    if gemm_runs_as(backend, a_fp8.shape[1], b_fp8.shape[1]) == "scaled_mm":
        # The kernel fuses a bias only for 16-bit outputs of the bias's dtype (torch 2.11
        # refuses one with float32 output); otherwise it is added afterwards.
        fused_bias = (
            bias
            if bias is not None
            and bias.dtype == out_dtype
            and out_dtype in (torch.bfloat16, torch.float16)
            else None
        )
        # Row-major a and column-major b, as the kernel requires. The checks first: even
        # no-op .contiguous()/.t() calls cost host time in a loop that launches per GEMM.
        if not a_fp8.is_contiguous():
            a_fp8 = a_fp8.contiguous()
        if b_fp8.stride(0) != 1 or b_fp8.stride(1) != b_fp8.shape[0]:
            b_fp8 = b_fp8.t().contiguous().t()
        out = torch._scaled_mm(
            a_fp8,
            b_fp8,
            scale_a=a_scale_inv,  # 1-element float32: tensor-wise scaling
            scale_b=b_scale_inv,
            bias=fused_bias,
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
        if bias is not None and fused_bias is None:
            out = out + bias
        return out, "scaled_mm"
    a_hp = dequantize(a_fp8, a_scale_inv, torch.float32)
    b_hp = dequantize(b_fp8, b_scale_inv, torch.float32)
    # In float32 whatever torch.autocast is in force: the emulation's numbers are the
    # product of the dequantized operands, not of their bf16 or fp16 roundings.
    with torch.autocast(a_hp.device.type, enabled=False):
        out = (a_hp @ b_hp).to(out_dtype)
    return (out if bias is None else out + bias), "emulated"
