"""fp8state against bf16 PyTorch, measured side by side in one run; prints one JSON object.

Usage (on an H200; the recorded run is benchmarks/results/h200.json)::

    python benchmarks/hopper.py --out benchmarks/results/h200.json

``--quick`` runs tiny shapes (on CPU too) so the script itself is tested in CI; its numbers mean
nothing. Ratios are ``bf16 time / fp8state time`` (> 1: fp8state is faster), both measured in
the same process on the same device: steady-state steps run back to back as in training
(:func:`steady_pair_ms`), and, in ``details``, steps synchronized one by one (``synced_*``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

import fp8state
from fp8state._runtime.amax_reduction import PendingSteps, reduce_and_update
from fp8state._runtime.slot_cast import cast_and_record
from fp8state.schema import PAYLOAD_KEYS

LINEAR_SHAPES = [
    (16384, 4096, 4096),
    (16384, 4096, 16384),
    (16384, 16384, 4096),
    (8192, 8192, 8192),
]
SMALL_SHAPE = (2048, 1024, 1024)
MLP = (16384, 4096, 16384)  # tokens, hidden, ffn
QUANT_SHAPE = (16384, 4096)
N_MODULES = 1000


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _once_ms(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall time of ``fn`` in milliseconds (synchronized around each call)."""
    for _ in range(warmup):
        fn()
    return statistics.median(_once_ms(fn, device) for _ in range(iters))


def time_pair_ms(
    a: Callable[[], object], b: Callable[[], object], device: torch.device, warmup: int, iters: int
) -> tuple[float, float]:
    """Median times of ``a`` and ``b``, measured alternately so both see the same clocks."""
    for _ in range(warmup):
        a()
        b()
    times_a, times_b = [], []
    for _ in range(iters):
        times_a.append(_once_ms(a, device))
        times_b.append(_once_ms(b, device))
    return statistics.median(times_a), statistics.median(times_b)


def steady_pair_ms(
    a: Callable[[], object],
    b: Callable[[], object],
    device: torch.device,
    warmup: int,
    blocks: int,
    steps: int = 10,
) -> tuple[float, float]:
    """Per-call times of ``a`` and ``b`` run back to back, as a training loop runs its steps.

    Blocks of ``steps`` calls, alternately of ``a`` and of ``b``, each timed from its first
    launch to its last kernel's end (CUDA events; wall clock on CPU) and synchronized only
    there: the host queues the next step while the GPU runs this one, so neither side pays a
    launch latency and a synchronization per step, which :func:`time_pair_ms` adds to both
    (moving every ratio towards 1). Medians over the blocks.
    """
    for _ in range(warmup):
        a()
        b()
    times_a, times_b = [], []
    for _ in range(blocks):
        times_a.append(_block_ms(a, device, steps))
        times_b.append(_block_ms(b, device, steps))
    return statistics.median(times_a), statistics.median(times_b)


def _block_ms(fn: Callable[[], object], device: torch.device, steps: int) -> float:
    if device.type != "cuda":
        return _once_ms(lambda: [fn() for _ in range(steps)], device) / steps
    sync(device)
    return _events_ms(fn, steps)


def _events_ms(fn: Callable[[], object], calls: int, sleep_cycles: int = 0) -> float:
    """Milliseconds per call of ``calls`` calls of ``fn`` between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def kernel_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Device time per call of ``fn``, launched back to back (CUDA events), for one kernel.

    Per-call synchronization would add the launch latency to a 50 us kernel; the bound it is
    compared with is a device-side figure too. Falls back to :func:`time_ms` on CPU.
    ``iters`` launches must take the host less than the GPU's sleep (about 50 ms).
    """
    if device.type != "cuda":
        return time_ms(fn, device, warmup, iters)
    for _ in range(warmup):
        fn()
    # The GPU sleeps while the host queues every launch, so the events time the kernels
    # back to back even when one launch costs the host more than one kernel takes.
    return _events_ms(fn, iters, sleep_cycles=100_000_000)


def spin_up(device: torch.device, seconds: float) -> None:
    """Keep the GPU busy for a while so clocks are up before the first measurement."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        sync(device)


def fwd_bwd(
    module: nn.Module, x: torch.Tensor, grad: torch.Tensor, fp8: bool
) -> Callable[[], None]:
    def step() -> None:
        with fp8state.fp8_autocast(enabled=fp8):
            y = module(x)
        y.backward(grad)
        x.grad = None
        for p in module.parameters():
            p.grad = None

    return step


def _ratio(
    bf16: nn.Module, fp8: nn.Module, tokens: int, k: int, n: int, device, args
) -> dict[str, float | None]:
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
    steps = fwd_bwd(bf16, x, grad, False), fwd_bwd(fp8, x, grad, True)
    t_bf16, t_fp8 = steady_pair_ms(*steps, device, args.warmup, args.iters)
    # Also with a synchronization around every step (the previous records' measure).
    s_bf16, s_fp8 = time_pair_ms(*steps, device, args.warmup, args.iters)
    return {
        "bf16_ms": t_bf16,
        "fp8_ms": t_fp8,
        "ratio": t_bf16 / t_fp8,
        "synced_bf16_ms": s_bf16,
        "synced_fp8_ms": s_fp8,
        "synced_ratio": s_bf16 / s_fp8,
    }


def bench_linear(shape, device, args) -> dict[str, float]:
    """fwd+bwd of nn.Linear (bf16) against fp8state.Linear under fp8_autocast."""
    tokens, k, n = shape
    bf16 = nn.Linear(k, n, device=device, dtype=torch.bfloat16)
    fp8 = fp8state.Linear(k, n, params_dtype=torch.bfloat16, device=device)
    return _ratio(bf16, fp8, tokens, k, n, device, args)


def _peak_mb(step: Callable[[], None], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None  # no allocator statistics on CPU
    step()
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def bench_mlp(device, args) -> dict[str, float | None]:
    """LayerNormMLP against nn.LayerNorm + 2 nn.Linear + GELU(tanh), time and peak memory."""
    tokens, hidden, ffn = args.mlp
    bf16 = nn.Sequential(
        nn.LayerNorm(hidden),
        nn.Linear(hidden, ffn),
        nn.GELU(approximate="tanh"),
        nn.Linear(ffn, hidden),
    ).to(device=device, dtype=torch.bfloat16)
    fp8 = fp8state.LayerNormMLP(hidden, ffn, params_dtype=torch.bfloat16, device=device)
    result = _ratio(bf16, fp8, tokens, hidden, hidden, device, args)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    result["bf16_peak_mb"] = _peak_mb(fwd_bwd(bf16, x, grad, False), device)
    result["fp8_peak_mb"] = _peak_mb(fwd_bwd(fp8, x, grad, True), device)
    bf16_mb, fp8_mb = result["bf16_peak_mb"], result["fp8_peak_mb"]
    result["peak_mem_ratio"] = fp8_mb / bf16_mb if fp8_mb and bf16_mb else None
    return result


def bench_quantize(device, args) -> dict[str, float]:
    """quantize+amax of a bf16 tensor against the bytes-moved bound at measured copy bandwidth."""
    x = torch.randn(*args.quant_shape, device=device, dtype=torch.bfloat16)
    scale = torch.tensor(1.0, device=device)
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(big)
    copy_ms = kernel_ms(lambda: dst.copy_(big), device, args.warmup, args.iters)
    bandwidth = 2 * big.numel() / (copy_ms * 1e-3)  # bytes read + written per second

    cell = torch.zeros(1, device=device)
    scale = scale.reshape(1)

    def quant() -> None:  # the fused kernel on CUDA: one read, one FP8 write, amax into cell
        cast_and_record(x, scale, cell, torch.float8_e4m3fn, transpose=False)

    t = kernel_ms(quant, device, args.warmup, args.iters)
    bound_ms = (x.numel() * (2 + 1)) / bandwidth * 1e3  # read bf16, write fp8
    return {"ms": t, "bound_ms": bound_ms, "copy_GBps": bandwidth / 1e9, "ratio": t / bound_ms}


def bench_metadata(device, args) -> dict[str, float]:
    """state_dict / load_state_dict / scale update of many FP8 Linear modules after training."""
    model = nn.ModuleList(fp8state.Linear(16, 16, device=device) for _ in range(args.modules))
    x = torch.randn(16, 16, device=device)
    for _ in range(2):
        with fp8state.fp8_autocast():
            out = sum(m(x).sum() for m in model)
        out.backward()
    sd_ms, load_ms = _state_dict_round_ms(model, device)
    pending = PendingSteps()
    recipe = fp8state.DelayedScaling()
    for m in model:
        pending.add(m, recipe, None)
    update_ms = time_ms(lambda: reduce_and_update("fwd", pending), device, 2, 10)
    # Context for the two rows above: the same container of plain nn.Linear (PyTorch's own
    # per-module cost, including load_state_dict's per-child filtering of the whole dict), and
    # of nn.Linear with a trivial extra state (the same three keys per module as fp8state's),
    # and the least a state_dict() with the schema's eleven tensors per module can cost.
    floors = {}
    for name, cls in (("plain_linear", nn.Linear), ("extra_state_linear", _ExtraStateLinear)):
        plain = nn.ModuleList(cls(16, 16, device=device) for _ in range(args.modules))
        (floors[f"{name}_state_dict_ms"], floors[f"{name}_load_state_dict_ms"]) = (
            _state_dict_round_ms(plain, device)
        )
    floors["schema_floor_state_dict_ms"] = _schema_floor_ms(args.modules, device)
    return {
        "state_dict_ms": sd_ms,
        "load_state_dict_ms": load_ms,
        "scale_update_ms": update_ms,
        **floors,
    }


def _state_dict_round_ms(model: nn.Module, device: torch.device) -> tuple[float, float]:
    """Median ms of ``model.state_dict()`` and of loading its result back."""
    # Python's cyclic collector, left with the garbage of the runs before, would otherwise
    # land its full collections in some samples: collect first, and take more samples.
    gc.collect()
    sd_ms = time_ms(model.state_dict, device, 2, 11)
    state = model.state_dict()
    gc.collect()
    return sd_ms, time_ms(lambda: model.load_state_dict(state), device, 2, 11)


def _schema_floor_ms(modules: int, device: torch.device) -> float:
    """Median ms of the least any ``state_dict()`` with the schema's payloads can do.

    A container of nn.Linear whose extra state is a new dict of eleven CPU tensors (the
    schema's keys), all made for all modules by one ``unbind`` before each call: no transfer,
    no copy, no check, no storage per module. Only the tensor objects, the dicts and
    PyTorch's walk over the modules remain, so ``state_dict_1000_ms`` cannot go below it.
    """
    model = nn.ModuleList(_SchemaFloorLinear(16, 16, device=device) for _ in range(modules))

    def state_dict() -> object:
        _SchemaFloorLinear.parts = iter(torch.zeros(modules * len(PAYLOAD_KEYS)).unbind())
        return model.state_dict()

    gc.collect()
    return time_ms(state_dict, device, 2, 11)


class _SchemaFloorLinear(nn.Linear):
    """nn.Linear whose extra state is the next eleven tensors of a shared iterator."""

    parts: Iterator[torch.Tensor] = iter(())

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return {key: next(self.parts) for key in PAYLOAD_KEYS}

    def set_extra_state(self, state: object) -> None:
        pass


class _ExtraStateLinear(nn.Linear):
    """nn.Linear with a one-tensor extra state that loads as nothing: PyTorch's floor."""

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return {"x": torch.zeros(())}

    def set_extra_state(self, state: object) -> None:
        pass


def main(argv: list[str] | None = None) -> dict:
    """Run every benchmark and return (and print) the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, to test the script")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.warmup, args.iters = (1, 2) if args.quick else (5, 20)
    shapes = [(64, 32, 48)] if args.quick else LINEAR_SHAPES
    small = (32, 32, 32) if args.quick else SMALL_SHAPE
    args.mlp = (64, 32, 64) if args.quick else MLP
    args.quant_shape = (64, 32) if args.quick else QUANT_SHAPE
    args.modules = 10 if args.quick else N_MODULES
    spin_up(device, 0.0 if args.quick else 2.0)
    linear = {"x".join(map(str, s)): bench_linear(s, device, args) for s in shapes}
    # A 0.2 ms step moves with the host's noise: ten times the samples for its median.
    small_res = bench_linear(
        small, device, argparse.Namespace(**{**vars(args), "iters": args.iters * 10})
    )
    mlp = bench_mlp(device, args)
    quant = bench_quantize(device, args)
    meta = bench_metadata(device, args)
    result = {
        "linear_speedup": {k: round(v["ratio"], 3) for k, v in linear.items()},
        "small_linear_speedup": round(small_res["ratio"], 3),
        "layernorm_mlp_speedup": round(mlp["ratio"], 3),
        "layernorm_mlp_peak_mem_ratio": (
            round(mlp["peak_mem_ratio"], 3) if mlp["peak_mem_ratio"] is not None else None
        ),
        "quantize_bound_ratio": round(quant["ratio"], 3),
        "state_dict_1000_ms": round(meta["state_dict_ms"], 2),
        "load_state_dict_1000_ms": round(meta["load_state_dict_ms"], 2),
        "scale_update_ms": round(meta["scale_update_ms"], 3),
        "details": {
            "linear": linear,
            "small_linear": small_res,
            "layernorm_mlp": mlp,
            "quantize": quant,
            "metadata": meta,
            "modules": args.modules,
        },
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
        # The output path is left out: it differs between the machine and the repository.
        "command": "python benchmarks/hopper.py" + (" --quick" if args.quick else ""),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
