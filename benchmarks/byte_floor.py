"""The most the model's FP8 steps can gain from faster casts: their bytes at the copy rate.

Usage (CUDA + Triton): ``python benchmarks/byte_floor.py [--out FILE]``.

``training_loop.py``'s floors run layers that skip work the model does (no transposed copies,
no GELU, no biases). This bound keeps that work. In an FP8 step of ``transformer.py``'s
model, fp8state's own kernels (the casts with their amaxes, GELU and column sums, the norms
computed by their outputs' casts, the norms' backward, the one-byte transposes, the scale
updates) read and write at least :func:`layer_bytes` per layer: every bf16 operand read
once and written in FP8 in both layouts, since Hopper's FP8 GEMMs take a row-major first
operand and a column-major second one, so each of a Linear's three GEMMs needs one of its
operands transposed. The rest of the step (GEMMs, attention, the residual and gradient
adds) is what bf16's or any FP8 implementation of these layers runs too.

No kernel moves its bytes faster than a device copy of as many, so with the rest of the
step as it is, a step can be no faster than ``fp8 - own + bytes / copy rate``, where
``fp8`` is the step's time, ``own`` the GPU time of fp8state's kernels in it
(``torch.profiler``) and the copy rate the best of device copies of 64 MiB to 1 GiB, all
measured in this process. Each case prints that bound as ``bound = bf16 / (fp8 - own +
bytes / rate)`` beside the measured ratio (:data:`MODES`; every GEMM in FP8): the graphed
1 x 2048 step (the whole step in one CUDA graph), the same with its gradients set to None
before each step (``graphed_fresh``: backward writes them, no add), the eager 4 x 2048 step
(as ``tune_fallback`` picks there) and the compiled 1 x 2048 step (``torch.compile``,
default mode). A bound below a target says no cast kernel, however fast, meets it while the
rest of the step stays as it is. The host is left out: it only lowers what an eager step
reaches. The compiled step's pace is its host's, so there ``fp8`` is the sum of its kernels
instead, less Inductor's layer norms (the norm casts' bytes hold theirs), against bf16
compiled's wall time: every choice in FP8's favour, so still an upper bound.

Small copies run below the copy rate, so each case also prints a per-launch bound
(``bound_per_launch``): every tensor of :func:`layer_bytes`, layer by layer, moved by one
device copy of as many bytes, the copies captured in one CUDA graph and timed back to back
(``launch_copies_ms``). It bounds layers that launch at least one kernel per tensor, as
fp8state's modules do: between one layer's activations and gradients stand the GEMMs,
attention and the user's residual adds, so only the weights, cast by each module in its own
forward, could be gathered into fewer launches, and ``bound`` still holds for that.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from hopper import kernel_ms, spin_up, steady_pair_ms  # benchmarks/ is on sys.path
from model_kernels import kernel_launches
from record import report
from training_loop import graphed
from transformer import MODEL, build_model, make_step, mark_graphed

# fp8state's Triton kernels (fp8state/_kernels): the work the byte count covers.
OWN_KERNELS = (
    "cast_kernel",
    "norm_cast_kernel",
    "norm_backward_kernel",
    "param_grads_kernel",
    "_transpose_kernel",
    "_update_kernel",
    "_batched_kernel",
    "_gather_kernel",
)

# The cases: how the step runs, and its sequences of 2048 tokens.
MODES = {"graphed": 1, "graphed_fresh": 1, "eager": 4, "compiled": 1}


def layer_bytes(tokens: int, hidden: int, ffn: int) -> dict[str, int]:
    """Bytes one layer's FP8 casts must read and write in a fwd+bwd, by tensor.

    Each cast reads its bf16 input (2 bytes an element) and writes the FP8 operand in both
    layouts (1 + 1); GELU's derivative reads the pre-activation too, and a norm's backward
    reads its input and the output's gradient and writes the input's gradient (bf16).
    Statistics, scales, histories and column sums are left out (they are small).
    """
    th, tf = tokens * hidden, tokens * ffn
    return {
        "norm and cast of the qkv input": 4 * th,
        "qkv weight": 4 * 3 * hidden * hidden,
        "projection input": 4 * th,
        "projection weight": 4 * hidden * hidden,
        "norm and cast of the fc1 input": 4 * th,
        "fc1 weight": 4 * ffn * hidden,
        "GELU and cast of the fc1 output": 4 * tf,
        "fc2 weight": 4 * hidden * ffn,
        "fc2 output gradient": 4 * th,
        "GELU's derivative and cast": 6 * tf,
        "norm backward before fc1": 6 * th,
        "projection output gradient": 4 * th,
        "qkv output gradient": 4 * 3 * th,
        "norm backward before qkv": 6 * th,
    }


def copy_rate(device: torch.device) -> float:
    """The best bytes per second (read + written) of device copies of 64 MiB to 1 GiB."""
    best = 0.0
    for size in (1 << 26, 1 << 28, 1 << 30):
        src = torch.empty(size, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ms = kernel_ms(lambda: dst.copy_(src), device, 3, 20)  # noqa: B023 (called here)
        best = max(best, 2 * size / (ms * 1e-3))
    return best


def launch_copies_ms(tokens: int, device: torch.device) -> float:
    """GPU milliseconds of one device copy per tensor of :func:`layer_bytes`, every layer.

    Each copy moves its tensor's bytes (read + written). One layer's buffers serve every
    layer, so a buffer comes back only after the layer's other copies have passed through L2.
    """
    sizes = layer_bytes(tokens, MODEL["hidden"], MODEL["ffn"]).values()
    buffers = [
        (
            torch.empty(n // 4, dtype=torch.bfloat16, device=device),
            torch.empty(n // 4, dtype=torch.bfloat16, device=device),
        )
        for n in sizes
    ]

    def copies() -> None:
        for _ in range(MODEL["layers"]):
            for dst, src in buffers:
                dst.copy_(src)

    copies()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copies()
    return kernel_ms(graph.replay, device, 3, 10)


def bench_case(batch: int, mode: str, rate: float, device: torch.device) -> dict[str, float]:
    """The measured ratio and both bounds of one case (``mode``: one of :data:`MODES`)."""
    x = torch.randn(batch, 2048, MODEL["hidden"], device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    models = {fp8: build_model(fp8, device) for fp8 in (True, False)}
    # The graphed threshold: every GEMM in FP8, eager or captured by hand (as model_kernels.py).
    mark_graphed(models[True], True)
    if mode == "compiled":
        models = {fp8: torch.compile(model) for fp8, model in models.items()}
    fresh = mode == "graphed_fresh"
    fp8, bf16 = (
        make_step(models[f], x.clone().requires_grad_(), grad, f, fresh) for f in (True, False)
    )
    launches = kernel_launches(fp8)
    own = sum(us for name, us in launches if name in OWN_KERNELS) / 1e3
    if mode.startswith("graphed"):
        fp8, bf16 = graphed(fp8), graphed(bf16)  # FP8's first; each its own input leaf
    bf16_ms, fp8_ms = steady_pair_ms(bf16, fp8, device, 5, 10)
    rest_ms = fp8_ms - own
    if mode == "compiled":
        # Its host, not its kernels, sets the compiled step's pace: bound its kernels instead,
        # less Inductor's layer norms, whose bytes the norm casts' count already holds.
        rest_ms = sum(us for name, us in launches if "layer_norm" not in name) / 1e3 - own
    tokens = x.shape[:2].numel()
    moved = MODEL["layers"] * sum(layer_bytes(tokens, MODEL["hidden"], MODEL["ffn"]).values())
    at_rate = moved / rate * 1e3
    per_launch = launch_copies_ms(tokens, device)
    return {
        "bf16_ms": round(bf16_ms, 3),
        "fp8_ms": round(fp8_ms, 3),
        "ratio": round(bf16_ms / fp8_ms, 3),
        "own_kernels_ms": round(own, 3),
        "rest_of_step_ms": round(rest_ms, 3),
        "own_bytes_gb": round(moved / 1e9, 3),
        "own_tb_per_s": round(moved / (own * 1e-3) / 1e12, 3),
        "own_at_copy_rate_ms": round(at_rate, 3),
        "bound": round(bf16_ms / (rest_ms + at_rate), 3),
        "own_as_launch_copies_ms": round(per_launch, 3),
        "bound_per_launch": round(bf16_ms / (rest_ms + per_launch), 3),
    }


def main(argv: list[str] | None = None) -> dict:
    """Measure both cases; print each, and merge the ``byte_floor`` key into ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    spin_up(device, 2.0)
    rate = copy_rate(device)
    result = {"copy_tb_per_s": round(rate / 1e12, 3)}
    print(json.dumps(result), flush=True)
    for mode, batch in MODES.items():
        name = f"{mode}_{batch}x2048"
        result[name] = bench_case(batch, mode, rate, device)
        print(json.dumps({name: result[name]}), flush=True)
        torch.cuda.empty_cache()
    result["gpu"] = torch.cuda.get_device_name(device)
    result["command"] = "python benchmarks/byte_floor.py"
    report({"byte_floor": result}, args.out)
    return result


if __name__ == "__main__":
    main()
