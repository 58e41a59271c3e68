"""Where the end-of-step scale update of many FP8 modules spends its time.

Usage: ``python benchmarks/scale_update_host.py [--modules 1000] [--device cuda]``.

The ``scale_update_ms`` row of ``hopper.py`` times :func:`reduce_and_update` for 1000 FP8
``Linear`` modules with a synchronization around each call. On CUDA that is one kernel
launch reading a cached pointer table, and host work per module: the table's check that no
buffer moved (``still_valid``) and closing each module's step. This script prints that row's
figure beside its parts, a JSON line per round: milliseconds per call synchronized (median),
on the host with calls back to back, on the GPU with calls queued behind a sleep kernel, and
the parts alone. On another device (``--device cpu``, which tests the script) the update is
the concatenated tensor path and there is no pointer table.

Run it on a copy of older code (``PYTHONPATH=<copy>``) to compare: where that code has no
``close_steps``, the modules' own ``_fp8_close_step`` is timed instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import fp8state
from fp8state._runtime import amax_reduction
from fp8state._runtime.amax_reduction import PendingSteps, reduce_and_update


def _per_call_ms(fn: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _closer(modules: list[nn.Module]) -> Callable[[], None]:
    """Close every module's forward step, as the update's end does."""
    try:
        from fp8state._runtime.friend import close_steps
    except ImportError:  # older code: one method call per module
        return lambda: [m._fp8_close_step("fwd") for m in modules]  # type: ignore[operator]
    return lambda: close_steps(modules, "fwd")


def measure(modules: int, device: torch.device, iters: int) -> dict[str, float]:
    """Milliseconds per forward update of ``modules`` Linears, and of its parts."""
    model = nn.ModuleList(fp8state.Linear(16, 16, device=device) for _ in range(modules))
    x = torch.randn(16, 16, device=device)
    for _ in range(2):
        with fp8state.fp8_autocast():
            out = sum(m(x).sum() for m in model)
        out.backward()
    pending, recipe = PendingSteps(), fp8state.DelayedScaling()
    for m in model:
        pending.add(m, recipe, None)

    def update() -> None:
        reduce_and_update("fwd", pending)

    for _ in range(5):
        update()
    _sync(device)
    synced = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        update()
        _sync(device)
        synced.append((time.perf_counter() - start) * 1e3)
    result = {
        "synchronized_ms": statistics.median(synced),
        "host_ms_back_to_back": _per_call_ms(update, iters),
        "close_steps_ms": _per_call_ms(_closer(list(model)), iters),
    }
    _sync(device)
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)  # the host queues every call before the GPU starts
        begin.record()
        for _ in range(iters):
            update()
        end.record()
        torch.cuda.synchronize(device)
        result["gpu_ms_queued"] = begin.elapsed_time(end) / iters
        table = next(iter(amax_reduction._TABLES.values()))
        result["still_valid_ms"] = _per_call_ms(table.still_valid, iters)
    return {k: round(v, 4) for k, v in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=1000)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="measured again, in one process")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(f"fp8state from {fp8state.__file__}, {args.modules} modules on {args.device}")
    for _ in range(args.rounds):
        print(json.dumps(measure(args.modules, torch.device(args.device), args.iters)))


if __name__ == "__main__":
    main()
