"""What folding the gradient's accumulation into the FP8 weight-gradient GEMM would save.

Usage (CUDA + Triton): ``python benchmarks/wgrad_accumulate_probe.py [--tokens 2048]
[--out FILE]``.

A step that lets gradients accumulate (the benchmarks' model steps, micro-batches before an
optimizer step) computes each weight's gradient into a new tensor and adds it to ``.grad``
in a second kernel, bf16 and fp8state alike: 4 bytes an element more than a GEMM that adds
into its output (the new tensor written, then read again by the add). TransformerEngine
folds that add into its weight-gradient GEMM (cuBLASLt with beta = 1, its
``fuse_wgrad_accumulation``); ``torch._scaled_mm`` has no such input, so a fold needs an FP8
GEMM of fp8state's own. This probe times, for each weight of ``transformer.MODEL``'s layers
at ``--tokens`` tokens, with the operands fp8state's backward holds (the output gradient's
transposed E5M2 copy, the input's transposed E4M3 copy):

- ``scaled_mm``: ``torch._scaled_mm`` alone, the weight gradient as fp8state computes it;
- ``scaled_mm_add``: that, then the add into the running sum (what a step runs today);
- ``triton``: a plain tiled Triton FP8 GEMM (``tl.dot``), its best configuration of
  :data:`CONFIGS`, writing a new tensor: how far such a GEMM is from cuBLAS;
- ``triton_acc``: the same GEMM adding into the running sum in its epilogue (the fold);
- ``bf16_mm_add``: bf16's weight gradient and add, for scale;
- ``triton_fast`` and ``triton_acc_fast``: the Triton GEMMs with Triton's default FP8
  accumulation on Hopper, the tensor cores' own throughout (as ``use_fast_accum``), where
  the two above add into float32 every tile of K as cuBLAS's full accumulation, fp8state's
  for gradients, does.

Each kernel is timed back to back with CUDA events (``hopper.kernel_ms``). ``per_step_ms``
sums each variant over the model's layers, and ``saving_ms`` is what the fold would take off
an accumulating step: ``scaled_mm_add - triton_acc``. ``bound_cublas_beta_ms`` is what a
cuBLAS fold could at best reach: ``scaled_mm`` plus reading the old sum at the copy rate
(``byte_floor.copy_rate``).
The fold's results are checked against ``scaled_mm_add`` (one bf16 rounding against two).
"""

from __future__ import annotations

import argparse
import functools
import itertools
from pathlib import Path

import torch
import triton
import triton.language as tl
from byte_floor import copy_rate  # benchmarks/ is on sys.path as a script
from hopper import kernel_ms, spin_up
from record import report
from transformer import MODEL

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): Triton's usual FP8 tiles on Hopper.
CONFIGS = [
    (128, 256, 128, 8, 3),
    (256, 128, 128, 8, 3),
    (128, 128, 128, 8, 4),
    (128, 128, 128, 4, 4),
    (128, 256, 64, 8, 4),
]

# The Triton variants: each one's label in ``configs_ms``, then its launches' flags
# (accumulate into the sum, full accumulation).
TRITON_VARIANTS = {
    "triton": ("new", False, True),
    "triton_fast": ("new_fast", False, False),
    "triton_acc": ("acc", True, True),
    "triton_acc_fast": ("acc_fast", True, False),
}


@triton.jit
def _gemm(
    a_ptr, b_ptr, c_ptr, scale_a_ptr, scale_b_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    ACCUMULATE: tl.constexpr, PRECISE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``C = scale_a * scale_b * A @ B`` (+ ``C`` with ``ACCUMULATE``); K a multiple of BLOCK_K.

    ``PRECISE``: the products join the float32 sum every BLOCK_K terms, as cuBLAS's full
    accumulation does (fp8state's gradient GEMMs); otherwise Triton's default on Hopper, the
    tensor cores' own accumulator throughout (``use_fast_accum``'s).
    """
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # Programs in groups of GROUP_M row tiles, so neighbours share operand tiles in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows % M)[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + (cols % N)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        if PRECISE:
            acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def triton_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    precise: bool,
    config: tuple[int, ...],
) -> torch.Tensor:
    """``out (+)= scale_a * scale_b * a @ b`` with one launch of :func:`_gemm`."""
    bm, bn, bk, warps, stages = config
    (m, k), n = a.shape, b.shape[1]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm[grid](
        a, b, out, scale_a, scale_b, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        ACCUMULATE=accumulate, PRECISE=precise, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def weights(hidden: int, ffn: int) -> dict[str, tuple[int, int]]:
    """One layer's weights, (out features, in features)."""
    return {
        "qkv": (3 * hidden, hidden),
        "proj": (hidden, hidden),
        "fc1": (ffn, hidden),
        "fc2": (hidden, ffn),
    }


def probe_weight(n: int, k: int, tokens: int, device: torch.device) -> dict[str, object]:
    """Every variant for one ``n x k`` weight's gradient over ``tokens`` rows."""
    g = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
    g8_t = g.t().contiguous().to(E5M2)  # (n, tokens) row-major: the first operand
    x8_cm = x.t().contiguous().to(E4M3).t()  # (tokens, k) column-major: the second
    one = torch.ones((), device=device)
    running = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    fresh = torch.empty_like(running)
    bf16_w = (g.t().contiguous(), x)

    def scaled() -> torch.Tensor:
        return torch._scaled_mm(g8_t, x8_cm, one, one, out_dtype=torch.bfloat16)

    times: dict[str, float | str] = {
        "scaled_mm": kernel_ms(scaled, device, 5, 50),
        "scaled_mm_add": kernel_ms(lambda: running.add_(scaled()), device, 5, 50),
        "bf16_mm_add": kernel_ms(lambda: running.add_(bf16_w[0] @ bf16_w[1]), device, 5, 50),
    }
    configs: dict[str, float | str] = {}  # by label, as recorded: a time or the error
    timed: dict[tuple[str, tuple[int, ...]], float] = {}  # by (variant, config)
    for config, (variant, (kind, *flags)) in itertools.product(CONFIGS, TRITON_VARIANTS.items()):
        label = f"{kind}:{'x'.join(map(str, config))}"
        out = running if flags[0] else fresh
        launch = functools.partial(triton_gemm, g8_t, x8_cm, one, one, out, *flags, config)
        try:
            timed[variant, config] = configs[label] = kernel_ms(launch, device, 5, 50)
        except Exception as error:  # a tile that does not fit shared memory, say
            configs[label] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    best = {
        variant: min((c for v, c in timed if v == variant), key=lambda c: timed[variant, c])
        for variant in TRITON_VARIANTS
    }
    for variant, config in best.items():
        times[variant] = timed[variant, config]
        times[f"{variant}_config"] = "x".join(map(str, config))
    # The fold's numbers: one rounding of (old + product) against the add of a rounded product,
    # in units of bf16's half step at the largest value.
    start = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    reference = start.float() + scaled().float()
    for variant in ("triton_acc", "triton_acc_fast"):
        folded = start.clone()
        triton_gemm(g8_t, x8_cm, one, one, folded, *TRITON_VARIANTS[variant][1:], best[variant])
        error = (folded.float() - reference).abs().max().item()
        times[f"{variant}_error_half_ulps"] = error / (reference.abs().max().item() * 2**-8)
    return {"times_ms": times, "configs_ms": configs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    spin_up(device, 2.0)
    rate = copy_rate(device)
    shapes = weights(MODEL["hidden"], MODEL["ffn"])
    per_weight = {name: probe_weight(n, k, args.tokens, device) for name, (n, k) in shapes.items()}
    layers = MODEL["layers"]
    per_step = {
        variant: layers * sum(float(w["times_ms"][variant]) for w in per_weight.values())
        for variant in ("scaled_mm", "scaled_mm_add", "bf16_mm_add", *TRITON_VARIANTS)
    }
    old_sum_bytes = layers * sum(2 * n * k for n, k in shapes.values())
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tokens": args.tokens,
        "copy_rate_tb_s": rate / 1e12,
        "per_weight": per_weight,
        "per_step_ms": per_step,
        "saving_ms": per_step["scaled_mm_add"] - per_step["triton_acc"],
        "bound_cublas_beta_ms": per_step["scaled_mm"] + old_sum_bytes / rate * 1e3,
    }
    report({"wgrad_accumulate_probe": result}, args.out)


if __name__ == "__main__":
    main()
