"""The 16-layer model compiled, in Inductor's modes, with FP8 from either threshold.

Usage (CUDA): ``python benchmarks/compiled_modes.py [--out benchmarks/results/h200.json]``.

``training_loop.py`` measures ``compiled_1x2048`` in the default mode, where fp8state's
modules keep the eager threshold (``fp8state.backends.DEFAULT_MIN_GEMM_MACS``): a compiled
step still queues every launch from the host. This compares, per mode (``default``,
``reduce-overhead``: Inductor's CUDA graphs), fp8state's model with that threshold and with
its modules marked ``fp8_graphed`` (every GEMM of the model in FP8), each against
``torch.nn``'s bf16 model compiled in the same mode, in the same process: ratios
``bf16 time / fp8state time`` (key ``compiled_modes_1x2048``). A mode that fails records
its error. Each step runs as a training loop's does: gradients dropped after it
(``zero_grad(set_to_none=True)``; accumulated across steps, they fail ``reduce-overhead`` for
bf16 too), and the model's input keeps no gradient of its own. ``--layers N`` builds N layers
instead of 16 (the key then names them). ``--quick`` (tiny model, default mode, CPU too)
tests the script.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hopper import spin_up, steady_pair_ms  # benchmarks/ is on sys.path as a script
from record import report
from training_loop import guarded
from transformer import build_model, make_step, mark_graphed

MODES = ("default", "reduce-overhead")


def _loop_step(model: torch.nn.Module, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` as a training loop runs it: a new iteration, then ``zero_grad``.

    ``cudagraph_mark_step_begin`` first, the gradients dropped afterwards
    (``zero_grad(set_to_none=True)``): with gradients accumulated across steps,
    ``reduce-overhead`` fails for bf16 as well ("accessing tensor output of CUDAGraphs that
    has been overwritten by a subsequent run", ``reduce_overhead_probe.py steady``).
    """

    def run() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        step()
        model.zero_grad(set_to_none=True)

    return run


def measure(mode: str, device: torch.device, args) -> dict[str, float | str]:
    """bf16 time / fp8state time in ``mode``, for both FP8 thresholds."""
    # The first layer's input as an embedding's output is: no gradient of its own kept
    # (a leaf input that requires one runs too: reduce_overhead_probe.py --input-grad).
    x = torch.randn(1, args.tokens, args.model["hidden"], device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    plain = build_model(False, device, **args.model)
    bf16 = _loop_step(plain, make_step(torch.compile(plain, mode=mode), x, grad, False))
    result: dict[str, float | str] = {}
    for name, graphed in (("eager_threshold", False), ("fp8_graphed", True)):
        model = build_model(True, device, **args.model)
        mark_graphed(model, graphed)
        fp8 = _loop_step(model, make_step(torch.compile(model, mode=mode), x, grad, True))
        result[name] = guarded(lambda: _ratio(fp8, bf16, device, args))  # noqa: B023
    torch._dynamo.reset()
    return result


def _ratio(fp8: Callable[[], None], bf16: Callable[[], None], device, args) -> float:
    bf16_ms, fp8_ms = steady_pair_ms(bf16, fp8, device, args.warmup, args.blocks)
    return round(bf16_ms / fp8_ms, 3)


def main(argv: list[str] | None = None) -> dict:
    """Measure every mode, print the JSON, merge it into ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny model, default mode")
    parser.add_argument("--layers", type=int, default=None, help="layers (default: 16)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.warmup, args.blocks = (1, 2) if args.quick else (3, 7)
    args.model = {"layers": 2, "hidden": 64, "ffn": 128, "heads": 4} if args.quick else {}
    args.model.setdefault("hidden", 2048)
    if args.layers:
        args.model["layers"] = args.layers
    args.tokens = 32 if args.quick else 2048
    spin_up(device, 0.0 if args.quick else 2.0)
    started = time.perf_counter()
    result: dict = {
        mode: guarded(lambda: measure(mode, device, args))  # noqa: B023
        for mode in (MODES[:1] if args.quick else MODES)
    }
    result["command"] = (
        "python benchmarks/compiled_modes.py"
        + (" --quick" if args.quick else "")
        + (f" --layers {args.layers}" if args.layers else "")
    )
    result["seconds"] = round(time.perf_counter() - started, 1)
    layers = f"_{args.layers}_layers" if args.layers else ""
    out = {f"compiled_modes_1x{args.tokens}{layers}": result}
    report(out, args.out)
    return out


if __name__ == "__main__":
    main()
