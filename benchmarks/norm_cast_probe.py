"""A norm and the FP8 cast of its output: separate kernels against one fused pass.

Usage (CUDA): ``python benchmarks/norm_cast_probe.py [--shapes 2048x2048 8192x2048] [--rms]
[--opening]``.

For each ``MxN`` bf16 input, device microseconds (CUDA graph of ``--reps`` launches, median of
replays) of: ``torch.nn.functional.layer_norm`` alone; it followed by fp8state's cast with
the transposed copy (the unfused forward of a ``LayerNormLinear``); the norm's backward
(``torch.ops.aten.native_layer_norm_backward``). Then, per row block, warps and program
count: the fused forward (:mod:`fp8state._kernels.triton_norm_cast`) alone and followed by
the one-byte transpose, with the bytes of its FP8 output that differ from the unfused cast's
and the largest differences of the rows' statistics; and the fused backward with the
partial rows summed by ``Tensor.sum`` (:mod:`fp8state._kernels.triton_norm_backward`),
with its largest relative differences from torch's.

``--opening``: only the fused forward, per row block, warps and program count, timed as a
later record of a step (its amax into row 0) and as the record that opens one (one more
program shifts a 1024-row history; every program gathers its amax in the history's scratch
pair and counts itself done, the last writing row 0): what
:func:`fp8state._kernels.norm_launch._forward_plan` chooses its opening plans by.

``--rms``: RMSNorm instead, with the launch plans LayerNorm's timings chose
(:mod:`fp8state._kernels.norm_launch`): ``F.rms_norm`` alone, followed by the cast with the
transposed copy, and torch's backward of it (autograd's; the summed GPU time of its kernels,
from the profiler), against the fused forward followed by the byte transpose and the fused
backward with its parameter-gradient sums.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import triton
from model_kernels import kernel_times  # benchmarks/ is on sys.path as a script
from overlap_probe import graph_us

from fp8state._kernels import norm_launch
from fp8state._kernels.cast_launch import cast_transpose_amax, history_blocks
from fp8state._kernels.scratch import scratch_pair
from fp8state._kernels.triton_norm_backward import norm_backward_kernel
from fp8state._kernels.triton_norm_cast import norm_cast_kernel
from fp8state._kernels.triton_transpose import transpose_bytes

E4M3 = torch.float8_e4m3fn
Launch = Callable[[], Any]


def _span(m: int, programs: int, block_m: int) -> int:
    """Rows per program: ``programs`` shares of ``m`` rounded up to whole row blocks."""
    return triton.cdiv(triton.cdiv(m, programs), block_m) * block_m


def fused(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    block_m: int,
    warps: int,
    programs: int,
    opening: bool = False,
) -> tuple[Launch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A launch of the fused forward on ``x``: amax into row 0, or with ``opening`` as the
    step's first record (one more program shifts a 1024-row history, the amax gathered in
    the history's scratch pair)."""
    m, n = x.shape
    dev = x.device
    out = torch.empty((m, n), dtype=E4M3, device=dev)
    mean, rstd = torch.empty(m, device=dev), torch.empty(m, device=dev)
    scale, inv = torch.ones(3, device=dev), torch.ones(3, device=dev)
    inv_out = torch.empty(1, device=dev)
    hist = torch.zeros(1024 if opening else 4, 3, device=dev)
    scratch = scratch_pair(hist) if opening else scale
    slots_block, chunk = history_blocks(3)
    span = _span(m, programs, block_m)

    def launch() -> torch.Tensor:
        norm_cast_kernel[(triton.cdiv(m, span) + opening,)](
            x, w, b, out, mean, rstd, scale, inv, inv_out, hist, scratch, 0, 3, hist.shape[0],
            m, n, span, 1e-5, block_m, triton.next_power_of_2(n), True, False, opening,
            slots_block, chunk, num_warps=warps,
        )  # fmt: skip
        return out

    return launch, out, mean, rstd


def backward(
    g: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    block_m: int,
    warps: int,
    programs: int,
) -> Launch:
    """A launch of the fused backward: dx, then the partial rows summed by ``Tensor.sum``."""
    m, n = x.shape
    dx = torch.empty_like(x)
    span = _span(m, programs, block_m)
    grid = triton.cdiv(m, span)
    partial = torch.empty(grid, 2, n, device=x.device)

    def launch() -> tuple[torch.Tensor, torch.Tensor]:
        norm_backward_kernel[(grid,)](
            g, x, w, mean, rstd, dx, partial, m, n, span, block_m, triton.next_power_of_2(n),
            True, False, num_warps=warps,
        )  # fmt: skip
        return dx, partial.sum(0)

    return launch


def _layer_norm_inputs(m: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bf16 ``(m, n)`` input off zero mean and unit scale, and LayerNorm's weight and bias."""
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 3 + 1
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.1
    return x, w, b


def _plans(m: int, n: int, program_counts: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """``(rows per block, warps, programs)`` of the fused kernels swept for an ``(m, n)`` input,
    leaving out those with fewer rows than programs or over 128 values a thread."""
    for block_m in (1, 2, 4):
        for warps in (4, 8):
            for programs in program_counts:
                if (
                    programs * block_m <= m
                    and block_m * triton.next_power_of_2(n) <= 128 * 32 * warps
                ):
                    yield block_m, warps, programs


def probe_shape(m: int, n: int, reps: int) -> None:
    """Print the separate kernels' times, then every fused configuration's, for ``m x n``."""
    x, w, b = _layer_norm_inputs(m, n)
    g = torch.randn_like(x)
    one, cell = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    normed, ref_mean, ref_rstd = torch.native_layer_norm(x, (n,), w, b, 1e-5)
    ref = cast_transpose_amax(normed, one, E4M3, cell, transpose=False)[0]
    ref_dx, ref_dw, _ = torch.ops.aten.native_layer_norm_backward(
        g, x, [n], ref_mean, ref_rstd, w, b, [True, True, True]
    )
    rows = {
        "layer_norm": graph_us(lambda: F.layer_norm(x, (n,), w, b), reps),
        "layer_norm + cast with transpose": graph_us(
            lambda: cast_transpose_amax(
                F.layer_norm(x, (n,), w, b), one, E4M3, cell, transpose=True
            ),
            reps,
        ),
        "layer_norm backward": graph_us(
            lambda: torch.ops.aten.native_layer_norm_backward(
                g, x, [n], ref_mean, ref_rstd, w, b, [True, True, True]
            ),
            reps,
        ),
    }
    print(f"{m}x{n}: { ({k: round(v, 1) for k, v in rows.items()}) }", flush=True)
    for block_m, warps, programs in _plans(m, n, (132, 264, 528, 1056)):
        launch, out, mean, rstd = fused(x, w, b, block_m, warps, programs)
        us = graph_us(launch, reps)
        both = graph_us(lambda launch=launch: transpose_bytes(launch()), reps)
        bad = (out.view(torch.uint8) != ref.view(torch.uint8)).sum().item()
        d_mean = (mean - ref_mean.flatten()).abs().max().item()
        d_rstd = ((rstd - ref_rstd.flatten()) / ref_rstd.flatten()).abs().max().item()
        back = backward(g, x, w, ref_mean, ref_rstd, block_m, warps, programs)
        b_us = graph_us(back, reps)
        dx, sums = back()
        d_dx = (dx.float() - ref_dx.float()).abs().max() / ref_dx.float().abs().max()
        d_dw = (sums[0] - ref_dw.float()).abs().max() / ref_dw.float().abs().max()
        print(
            f"  rows {block_m} warps {warps} programs {programs}: fwd {us:.1f} us, "
            f"+ byte transpose {both:.1f}; {bad} bytes differ, mean {d_mean:.1e}, "
            f"rstd {d_rstd:.1e} | bwd {b_us:.1f} us, dx {d_dx.item():.1e}, "
            f"dw {d_dw.item():.1e}",
            flush=True,
        )


def probe_opening(m: int, n: int, reps: int) -> None:
    """Print every fused forward configuration's time as a later record and as an opening one."""
    x, w, b = _layer_norm_inputs(m, n)
    plans = {
        when: norm_launch._forward_plan(m, n, when == "opening") for when in ("later", "opening")
    }
    print(f"{m}x{n}, the plans (programs, span, rows, columns, warps): {plans}", flush=True)
    for block_m, warps, programs in _plans(m, n, (132, 198, 264, 396, 528)):
        later = graph_us(fused(x, w, b, block_m, warps, programs)[0], reps)
        opening = graph_us(fused(x, w, b, block_m, warps, programs, True)[0], reps)
        print(
            f"  rows {block_m} warps {warps} programs {programs}: later record "
            f"{later:.1f} us, opening {opening:.1f} us",
            flush=True,
        )


def probe_rms(m: int, n: int, reps: int) -> None:
    """Print RMSNorm's separate kernels' times against the fused ones' for ``m x n``."""
    x = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 3 + 1).requires_grad_()
    w = (torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5).requires_grad_()
    g = torch.randn_like(x)
    one, cell = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    hist = torch.zeros(4, 1, device="cuda")
    with torch.no_grad():
        ref = cast_transpose_amax(F.rms_norm(x, (n,), w), one, E4M3, cell, transpose=False)[0]
    out = F.rms_norm(x, (n,), w)

    def torch_backward() -> None:
        torch.autograd.grad(out, (x, w), g, retain_graph=True)

    def fused_forward() -> torch.Tensor:
        got = norm_launch.norm_cast_slot(
            x.detach(), w.detach(), None, 1e-6, one, one, hist, 0, E4M3, False, rms=True
        )
        return got[0]

    with torch.no_grad():
        rstd = norm_launch.norm_cast_slot(
            x.detach(), w.detach(), None, 1e-6, one, one, hist, 0, E4M3, False, rms=True
        )[3]
        rows = {
            "rms_norm": graph_us(lambda: F.rms_norm(x, (n,), w), reps),
            "rms_norm + cast with transpose": graph_us(
                lambda: cast_transpose_amax(F.rms_norm(x, (n,), w), one, E4M3, cell, True), reps
            ),
            "fused + byte transpose": graph_us(lambda: transpose_bytes(fused_forward()), reps),
            "fused backward": graph_us(
                lambda: norm_launch.norm_backward(
                    g, x.detach(), w.detach(), None, None, rstd, True
                ),
                reps,
            ),
        }
        bad = (fused_forward().view(torch.uint8) != ref.view(torch.uint8)).sum().item()
    # Autograd's backward cannot be captured from here: its kernels' summed GPU time instead.
    rows["rms_norm backward (autograd, kernels)"] = sum(
        us for _, us in kernel_times(torch_backward).values()
    )
    print(
        f"{m}x{n} RMSNorm: { ({k: round(v, 1) for k, v in rows.items()}) }, "
        f"{bad} of {m * n} FP8 bytes differ from the unfused cast",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["2048x2048", "8192x2048", "8192x4096"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rms", action="store_true", help="RMSNorm, with the default plans")
    parser.add_argument(
        "--opening", action="store_true", help="the forward's plans, later and opening records"
    )
    args = parser.parse_args()
    probe = probe_rms if args.rms else probe_opening if args.opening else probe_shape
    for shape in args.shapes:
        m, n = map(int, shape.split("x"))
        probe(m, n, args.reps)


if __name__ == "__main__":
    main()
