"""Host-side cost of one FP8 Linear step: implicit syncs, launches and Python time.

Usage (CUDA): ``python benchmarks/host_overhead.py [--shape 16384x4096x4096]``.

Prints (1) any implicit device synchronization inside a step (``torch.cuda`` sync debug mode),
(2) host microseconds per fwd+bwd step at a shape whose GPU work is negligible, for bf16
nn.Linear and fp8state.Linear, (3) the top Python functions by cumulative time (cProfile) and
(4) at ``--shape``: synchronized wall time per step against the summed GPU kernel time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
import warnings

import torch
from hopper import fwd_bwd  # the step the benchmark times (benchmarks/ is on sys.path)
from torch import nn
from torch.profiler import ProfilerActivity, profile

import fp8state


def build(tokens: int, k: int, n: int, fp8: bool):
    if fp8:
        module = fp8state.Linear(k, n, params_dtype=torch.bfloat16, device="cuda")
        module.fp8_min_gemm_macs = 0
    else:
        module = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
    return fwd_bwd(module, x, grad, fp8)


def host_us(step, iters: int = 200, warmup: int = 20) -> float:
    """Host microseconds per call of ``step``, launched back to back (GPU not waited for)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / iters * 1e6


def launch_profile(iters: int = 5000) -> None:
    """cProfile of the library's launch wrappers alone (scale update, slot cast)."""
    from fp8state._kernels.triton_update import update_scales_
    from fp8state._runtime.slot_cast import cast_slot

    hist = torch.zeros(1024, 3, device="cuda")
    sc, inv = torch.ones(3, device="cuda"), torch.ones(3, device="cuda")
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)

    def both() -> None:
        update_scales_(hist, sc, inv, window=1024, algo="max", fp8_max=448.0, margin=0)
        cast_slot(x, sc, inv, hist, 1, torch.float8_e4m3fn, transpose=True, new_step=False)

    for _ in range(50):
        both()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        both()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def pieces() -> None:
    """Host microseconds per call of each piece of a step, on tiny tensors."""
    from fp8state._kernels.triton_update import update_scales_
    from fp8state._runtime.slot_cast import cast_and_record
    from fp8state.scaling import shift_history

    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    scale = torch.ones(1, device="cuda")
    cell = torch.zeros(1, device="cuda")
    hist = torch.zeros(1024, 3, device="cuda")
    sc, inv = torch.ones(3, device="cuda"), torch.ones(3, device="cuda")
    a8 = torch.zeros(64, 64, device="cuda", dtype=torch.float8_e4m3fn)
    layer = fp8state.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
    layer.fp8_min_gemm_macs = 0

    def fwd_only() -> None:
        with fp8state.fp8_autocast():
            layer(x)

    def autocast_empty() -> None:
        with fp8state.fp8_autocast():
            pass

    rows = {
        "torch.add (reference op)": lambda: x.add(1),
        "clone 1 elem": lambda: scale.clone(),
        "cast_and_record": lambda: cast_and_record(
            x, scale, cell, torch.float8_e4m3fn, transpose=False
        ),
        "cast_and_record transpose": lambda: cast_and_record(
            x, scale, cell, torch.float8_e4m3fn, transpose=True
        ),
        "update_scales_": lambda: update_scales_(
            hist, sc, inv, window=1024, algo="max", fp8_max=448.0, margin=0
        ),
        "shift history": lambda: hist.copy_(shift_history(hist)),
        "_scaled_mm": lambda: torch._scaled_mm(a8, a8.t(), scale, scale, out_dtype=torch.bfloat16),
        "fp8_autocast empty": autocast_empty,
        "Linear fwd under autocast (grad)": fwd_only,
    }
    from fp8state._kernels import triton_update as tu

    args = (hist, sc, inv, 3, 1024, 448.0, 0)
    consts = {"MOST_RECENT": False, "BLOCK": 16, "ROWS": 256, "f32_tiny": 1e-38, "f32_max": 3e38}
    compiled = tu._update_kernel[(1,)](*args, **consts)
    rows["jit launch (no device ctx)"] = lambda: tu._update_kernel[(1,)](*args, **consts)
    all_args = (*args, False, 16, 256, 1e-38, 3e38)
    runner = compiled[(1, 1, 1)]
    rows["compiled[grid](all args)"] = lambda: runner(*all_args)
    stream = torch.cuda.current_stream().cuda_stream
    rows["compiled.run direct"] = lambda: compiled.run(
        1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *all_args
    )
    rows["torch.empty(1)"] = lambda: torch.empty(1, device="cuda")
    dev = torch.device("cuda", 0)

    def device_ctx() -> None:
        with torch.cuda.device(dev):
            pass

    rows["with torch.cuda.device"] = device_ctx
    for name, fn in rows.items():
        try:
            print(f"piece {name}: {host_us(fn, 2000, 50):.1f} us")
        except Exception as exc:  # a piece that does not run on this Triton version
            print(f"piece {name}: failed: {type(exc).__name__}: {exc}")


def _timed(table: dict[str, float], name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name] = table.get(name, 0.0) + time.perf_counter() - start

    return wrapper


def breakdown(step, iters: int = 300) -> None:
    """Inclusive host time per step of fp8state's functions (perf_counter wrappers)."""
    import fp8state._kernels.cast_launch as cast_launch
    import fp8state._kernels.triton_update as triton_update
    import fp8state._runtime.amax_reduction as amax_reduction
    import fp8state._runtime.context_stack as context_stack
    import fp8state._runtime.slot_cast as cast_mod
    import fp8state.autocast as autocast_mod
    import fp8state.functional._slot as slot_mod
    import fp8state.functional.linear as fl
    import fp8state.mixin as mixin_mod

    table: dict[str, float] = {}
    patches = [
        (fl, "_cast_slot"),
        (fl, "fp8_gemm"),
        (fl, "_cast_weight"),
        (slot_mod, "cast_slot"),
        (context_stack, "reduce_and_update"),  # forward: the context's exit
        (autocast_mod, "reduce_and_update"),  # backward: its end
        (autocast_mod, "register_backward"),
        (autocast_mod, "register_forward"),
        (fl, "resolve_backend"),
        (cast_launch, "_LAUNCHER"),
        (triton_update, "_UPDATE"),
        (cast_launch, "_launch"),
        (amax_reduction, "_update_batched"),
        (cast_mod, "fused_kernel_available"),
    ]
    saved = []
    for mod, name in patches:
        fn = getattr(mod, name, None)
        if fn is None:  # renamed since this script was written: say so, measure the rest
            print(f"breakdown: {mod.__name__}.{name} not found")
            continue
        saved.append((mod, name, fn))
        setattr(mod, name, _timed(table, name, fn))
    cls = mixin_mod.FP8StateMixin
    saved_cell = cls.fp8_open_record
    cls.fp8_open_record = _timed(table, "fp8_open_record", saved_cell)
    try:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        table.clear()
        t = time.perf_counter()
        for _ in range(iters):
            step()
        total = time.perf_counter() - t
        torch.cuda.synchronize()
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
        cls.fp8_open_record = saved_cell
    print(f"breakdown: {total / iters * 1e6:.0f} us/step (with wrappers)")
    for name, sec in sorted(table.items(), key=lambda kv: -kv[1]):
        print(f"    {name}: {sec / iters * 1e6:.1f} us/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16384x4096x4096")
    args = parser.parse_args()

    small = build(256, 1024, 1024, True)
    small()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            small()
    torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0] for w in caught]
    print(f"implicit syncs in 3 fp8 steps: {len(syncs)}")
    for line in sorted(set(syncs)):
        print("   ", line)

    bf16_small = build(256, 1024, 1024, False)
    print(f"host us/step: bf16 {host_us(bf16_small):.0f}, fp8 {host_us(small):.0f}")

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        small()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    pieces()
    launch_profile()
    breakdown(small)

    tokens, k, n = map(int, args.shape.split("x"))
    for fp8 in (False, True):
        step = build(tokens, k, n, fp8)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        walls = []
        for _ in range(20):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t) * 1e3)
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        gpu_ms = sum(e.device_time_total for e in p.key_averages()) / 5 / 1e3
        walls.sort()
        print(
            f"{'fp8' if fp8 else 'bf16'} {args.shape}: wall {walls[10]:.3f} ms/step "
            f"(synchronized), GPU kernels {gpu_ms:.3f} ms/step"
        )
        if fp8:
            print(
                p.key_averages().table(
                    sort_by="cuda_time_total", row_limit=15, max_name_column_width=50
                )
            )


if __name__ == "__main__":
    main()
