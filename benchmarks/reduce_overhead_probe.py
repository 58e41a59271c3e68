"""What ``torch.compile(mode="reduce-overhead")`` does with fp8state's operators in its graphs.

Usage (CUDA)::

    python benchmarks/reduce_overhead_probe.py steady [--layers 16] [--input-grad]
    TORCH_LOGS="perf_hints,cudagraphs" python benchmarks/reduce_overhead_probe.py trace

fp8state's casts and FP8 GEMM carry ``torch.Tag.cudagraph_unsafe`` (the casts' Python must
run every step, and their FP8 outputs are new memory every step), so Inductor either splits a
graph around them into several CUDA graphs (its default,
``torch._inductor.config.graph_partition = True``) or, without partitions, runs that graph
without CUDA graphs. Both parts compile ``transformer.py``'s model in that mode, with a
first-layer input that keeps no gradient (an embedding's output), and call
``torch.compiler.cudagraph_mark_step_begin()`` before each step.

- ``steady``: milliseconds per step in steady state (:func:`hopper.steady_pair_ms`, after six
  steps), or the error, for bf16 and fp8state (the eager threshold, and every GEMM in FP8),
  with gradients accumulated across steps or dropped after each (``zero_grad``);
  ``--input-grad``: the input a leaf that requires a gradient (dropped with the others).
- ``trace``: the synchronized wall time of each of the first steps (the first compiles), and
  Inductor's counters (partitions, recordings), with partitions on and off; for the first
  case, one more step profiled: ``CUDAGraphNode.record`` in it means CUDA graphs recorded
  again rather than replayed. ``TORCH_LOGS`` as above logs the partitions and, for each
  recording again, its reason.

Each case builds its model and input afresh (a case that fails leaves nothing to the next).
"""

from __future__ import annotations

import argparse
import time
import traceback

import torch
import torch._inductor.config as inductor_config
from hopper import steady_pair_ms  # benchmarks/ is on sys.path as a script
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile
from transformer import build_model, make_step, mark_graphed

DEVICE = torch.device("cuda")


def _inputs(input_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(1, 2048, 2048, device=DEVICE, dtype=torch.bfloat16, requires_grad=input_grad)
    return x, torch.randn_like(x)


def _compiled_step(fp8: bool, every: bool, layers: int, drop: bool, x, grad):
    model = build_model(fp8, DEVICE, layers=layers)
    if fp8:
        mark_graphed(model, every)
    step = make_step(torch.compile(model, mode="reduce-overhead"), x, grad, fp8)

    def run() -> None:
        torch.compiler.cudagraph_mark_step_begin()
        step()
        if drop:
            model.zero_grad(set_to_none=True)
            x.grad = None

    return run


def steady(layers: int, input_grad: bool) -> None:
    """Print steady-state milliseconds per step (or the error) per case.

    Args:
        layers: The model's layers.
        input_grad: Make the input a leaf that requires a gradient.
    """
    cases = [
        ("bf16 accumulate", False, False, False),
        ("bf16 zeroed", False, False, True),
        ("fp8 eager-threshold zeroed", True, False, True),
        ("fp8 graphed-threshold zeroed", True, True, True),
        ("fp8 eager-threshold accumulate", True, False, False),
    ]
    for name, fp8, every, drop in cases:
        torch._dynamo.reset()
        x, grad = _inputs(input_grad)
        run = _compiled_step(fp8, every, layers, drop, x, grad)
        try:
            started = time.time()
            for _ in range(6):
                run()
            torch.cuda.synchronize()
            ms, _ = steady_pair_ms(run, run, DEVICE, 2, 5)
            line = f"ok {ms:.2f} ms/step (compile+6 steps {time.time() - started:.0f}s)"
        except Exception as exc:  # a case that fails prints its error
            line = "error: " + str(exc).splitlines()[0][:200]
            traceback.print_exc(limit=3)
        print(name, line, flush=True)


def trace() -> None:
    """Print per-step wall times and Inductor's counters, partitions on and off."""
    _trial("fp8 every GEMM", True, True, True, profiled=True)
    _trial("fp8 every GEMM", True, True, False)
    _trial("bf16", False, False, True)
    _trial("fp8 every GEMM (4 layers)", True, True, True, layers=4, steps=5)


def _trial(label, fp8, every, partition, layers=2, steps=8, profiled=False) -> None:
    torch._dynamo.reset()
    counters.clear()
    inductor_config.graph_partition = partition
    x, grad = _inputs()
    run = _compiled_step(fp8, every, layers, True, x, grad)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(round((time.perf_counter() - start) * 1e3, 1))
    print(label, "partition", partition, "ms per step:", times, flush=True)
    kept = {k: dict(v) for k, v in counters.items() if k in ("inductor", "stats")}
    print("   counters:", kept, flush=True)
    if profiled:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("steady", "trace"))
    parser.add_argument("--layers", type=int, default=4, help="steady: the model's layers")
    parser.add_argument("--input-grad", action="store_true", help="steady: the input a leaf")
    args = parser.parse_args()
    saved = inductor_config.graph_partition
    try:
        steady(args.layers, args.input_grad) if args.part == "steady" else trace()
    finally:
        inductor_config.graph_partition = saved


if __name__ == "__main__":
    main()
