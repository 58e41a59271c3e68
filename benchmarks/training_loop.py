"""FP8 in the loops people run: Linear sweep, a 16-layer model eager/graphed/compiled, host time.

Usage (on an H200; the recorded keys are in benchmarks/results/h200.json)::

    python benchmarks/training_loop.py --out benchmarks/results/h200.json

Every ratio is ``bf16 time / fp8state time`` for the same work in the same mode, measured in
the same process (> 1: FP8 is faster):

- ``sweep_speedup``: ``fp8state.Linear`` against ``nn.Linear``, fwd+bwd, at twelve shapes
  ``MxKxN``, steady-state blocks of steps (:func:`hopper.steady_pair_ms`). The modules keep
  their defaults, fallback included: what a user gets.
- ``model_h2048_speedup``: 16 pre-LN layers of hidden 2048, ffn 8192, 16 heads, SDPA
  attention; per layer ``LayerNormLinear`` (qkv), ``Linear`` (projection), ``LayerNormMLP``
  against the same layers from ``torch.nn``; fwd+bwd of ``eager_1x2048``, ``eager_4x2048``
  tokens, ``graphed_1x2048`` (the whole step in one ``torch.cuda.CUDAGraph``; the gradients
  accumulate from step to step, as in every mode here but one), ``graphed_fresh_1x2048`` (the
  same with the gradients set to None before each step, as ``zero_grad()`` does by default
  and torch's whole-network capture before capturing: backward writes them, no add),
  ``graphed_fresh_ahead_1x2048`` (that step with fp8state's forward in a
  ``fp8state.cast_weights_ahead`` block: the weights cast together before the first layer),
  ``graphed_layers_1x2048`` (each layer graphed by ``fp8state.make_graphed_callables``,
  against ``torch.cuda.make_graphed_callables`` for bf16), ``graphed_layers_cached_1x2048``
  (the same with ``fp8_weight_caching``: four micro-batches per optimizer step, the FP8
  weights cast on the first only) and
  ``compiled_1x2048`` (``torch.compile``, default mode). A mode that fails records its error.
  ``tuned_eager_1x2048`` / ``tuned_eager_4x2048``: the eager step after
  ``fp8state.tune_fallback`` timed it at each threshold (``fallback_tuning``: per batch the
  threshold chosen, the GEMM sizes it runs in FP8 and the milliseconds per step of each
  candidate).
  The whole-step graph is captured by hand, so its FP8 modules are marked ``fp8_graphed``
  (the graphed default threshold), as ``make_graphed_callables`` marks its own.
  ``floor_eager_1x2048`` / ``floor_eager_4x2048``: the same model with every FP8 layer the
  least any eager FP8 GEMM can launch (``host_floor.FloorLinear``: casts without amaxes,
  LayerNorm and GELU fused into the casts, no transposes, no bookkeeping): an upper bound on
  what any eager FP8 implementation of this model reaches. ``floor_graphed_1x2048``: that
  model captured in one CUDA graph against bf16's graph: with the host out of the step, what
  FP8 GEMMs and the least casting can save on the GPU, an upper bound on the graphed ratio
  of any implementation of these layers (CUDA only). ``floor_compiled_1x2048``: that model
  compiled (default mode) against bf16 compiled: Inductor may fuse or drop what it likes of
  the floor's work, so this bounds any FP8 implementation that ``torch.compile`` runs.
- ``sweep_context_ceiling``: per sweep shape, ``nn.Linear`` stepped inside ``fp8_autocast``
  against ``nn.Linear`` alone: the context's own host cost, which every fp8state step pays.
  Where a module falls back to high precision (``nn.Linear``'s very kernels), its step can
  beat this ratio by no means. ``sweep_floor``: per shape, the least FP8 step
  (``host_floor.floor_step``) against ``nn.Linear``: no FP8 Linear step beats it. Where both
  are below 1, no step of an FP8 module inside ``fp8_autocast`` is as fast as ``nn.Linear``.
- ``host_overhead_ratio``: host time to queue one fwd+bwd of ``fp8state.Linear`` over that
  of ``nn.Linear`` at 4096x2048x2048 (the GPU not waited for); ``host_floor_ratio``: the
  same for the least any eager FP8 Linear step can launch (``benchmarks/host_floor.py``).
- ``compile_graph_breaks`` / ``compile_recompiles``: dynamo's counts over 20 compiled steps
  of the model (:func:`compile_counts` says what a recompilation is).

``--quick`` (tiny shapes, on CPU too) tests the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import itertools
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from hopper import spin_up, steady_pair_ms
from host_floor import floor_model_step, floor_step  # benchmarks/ on sys.path
from record import report
from torch import nn
from transformer import MODEL, build_model, make_step, mark_graphed

import fp8state
from fp8state.graphs._capture import _collector_paused

SWEEP = [(m, k, k) for m in (2048, 4096, 8192) for k in (1024, 2048, 4096, 8192)]
HOST_SHAPE = (4096, 2048, 2048)
COMPILED_STEPS = 20
MICROBATCHES = 4  # per optimizer step, where FP8 weights are cached across micro-batches


def graphed(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` captured whole in one CUDA graph (warm-up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # A graph the collector frees mid-capture fails it: the library's own guard (graphs.md).
    with _collector_paused(), torch.cuda.graph(graph):
        step()
    return graph.replay


def _pair(fp8: Callable, bf16: Callable, device: torch.device, args) -> float:
    bf16_ms, fp8_ms = steady_pair_ms(bf16, fp8, device, args.warmup, args.blocks)
    return round(bf16_ms / fp8_ms, 3)


def bench_sweep(device: torch.device, args) -> dict[str, dict[str, float]]:
    """Per shape, against nn.Linear: fp8state.Linear; nn.Linear inside fp8_autocast (the
    context's own cost: the ceiling of a step that falls back); the least FP8 step."""
    result, context, floor = {}, {}, {}
    for m, k, n in args.sweep:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        fp8 = fp8state.Linear(k, n, params_dtype=torch.bfloat16, device=device)
        bf16 = nn.Linear(k, n, device=device, dtype=torch.bfloat16)
        plain = make_step(bf16, x, grad, False)
        result[f"{m}x{k}x{n}"] = _pair(make_step(fp8, x, grad, True), plain, device, args)
        context[f"{m}x{k}x{n}"] = _pair(make_step(bf16, x, grad, True), plain, device, args)
        floor[f"{m}x{k}x{n}"] = _pair(floor_step(m, k, n, device), plain, device, args)
        del x, grad, fp8, bf16
    return {"sweep_speedup": result, "sweep_context_ceiling": context, "sweep_floor": floor}


def bench_model(device: torch.device, args) -> tuple[dict[str, float | str], dict]:
    result: dict[str, float | str] = {}
    counts: dict = {}
    tunings: dict[str, dict] = {}
    h = args.model.get("hidden", MODEL["hidden"])
    for batch in (1, 4):
        models = {fp8: build_model(fp8, device, **args.model) for fp8 in (True, False)}
        x = torch.randn(batch, args.tokens, h, device=device, dtype=torch.bfloat16)
        x.requires_grad_()
        grad = torch.randn_like(x)
        steps = {fp8: make_step(models[fp8], x, grad, fp8) for fp8 in (True, False)}
        tag = f"{batch}x{args.tokens}"
        result[f"eager_{tag}"] = _pair(steps[True], steps[False], device, args)
        result[f"tuned_eager_{tag}"], tunings[tag] = _tuned(models[True], steps, device, args)
        floor = build_model(False, device, batch * args.tokens, **args.model)
        result[f"floor_eager_{batch}x{args.tokens}"] = _pair(
            floor_model_step(floor, x, grad), steps[False], device, args
        )
        del floor
        if batch == 1:
            counts = _other_modes(models, steps, x, grad, device, args, result)
    return result, {**counts, "fallback_tuning": tunings}


def _tuned(model: nn.Module, steps: dict, device: torch.device, args) -> tuple[float, dict]:
    """fp8state with ``fp8state.tune_fallback``'s threshold against bf16; then the defaults
    again (the other modes measure what the modules do by default)."""
    counts = {"steps": 1, "repeats": 1, "warmup": 0} if args.quick else {}
    tuning = fp8state.tune_fallback(model, steps[True], **counts)
    ratio = _pair(steps[True], steps[False], device, args)
    for module in model.modules():
        if isinstance(module, fp8state.FP8StateMixin):
            module.fp8_min_gemm_macs = None
    return ratio, {
        "chosen": tuning.chosen,
        "fp8_gemm_macs": list(tuning.fp8_gemm_macs(tuning.chosen)),
        "ms_per_step": {str(k): round(v, 3) for k, v in tuning.ms_per_step.items()},
    }


def _other_modes(models, steps, x, grad, device, args, result) -> dict:
    """Graphed and compiled steps of one sequence, and their floors; returns counts."""
    tag = f"1x{args.tokens}"
    if device.type == "cuda":
        mark_graphed(models[True], True)  # captured by hand: the modules say so
        bf16_graphed = guarded(lambda: graphed(steps[False]))
        if isinstance(bf16_graphed, str):  # bf16's capture failed: both ratios say why
            result[f"graphed_{tag}"] = result[f"floor_graphed_{tag}"] = bf16_graphed
        else:
            result[f"graphed_{tag}"] = guarded(
                lambda: _pair(graphed(steps[True]), bf16_graphed, device, args)
            )
            floor = build_model(False, device, args.tokens, **args.model)
            result[f"floor_graphed_{tag}"] = guarded(
                lambda: _pair(graphed(floor_model_step(floor, x, grad)), bf16_graphed, device, args)
            )
            del floor
            result[f"graphed_fresh_{tag}"] = guarded(
                lambda: _graphed_fresh(models, x, grad, device, args)
            )
            result[f"graphed_fresh_ahead_{tag}"] = guarded(
                lambda: _graphed_fresh(models, x, grad, device, args, ahead=True)
            )
        mark_graphed(models[True], False)  # compiled steps queue launches as eager ones do
        result[f"graphed_layers_{tag}"] = guarded(lambda: _graphed_layers(x, grad, device, args))
        result[f"graphed_layers_cached_{tag}"] = guarded(
            lambda: _graphed_layers(x, grad, device, args, MICROBATCHES)
        )
    compiled = {fp8: make_step(torch.compile(models[fp8]), x, grad, fp8) for fp8 in (True, False)}
    counts = guarded(lambda: compile_counts(compiled[True]))
    result[f"compiled_{tag}"] = guarded(
        lambda: _pair(compiled[True], compiled[False], device, args)
    )
    floor = torch.compile(build_model(False, device, args.tokens, **args.model))
    result[f"floor_compiled_{tag}"] = guarded(
        lambda: _pair(floor_model_step(floor, x, grad), compiled[False], device, args)
    )
    return counts if isinstance(counts, dict) else {"compile_error": counts}


def _graphed_fresh(
    models: dict, x: torch.Tensor, grad: torch.Tensor, device, args, ahead: bool = False
) -> float:
    """Both whole-step graphs, each step setting its gradients to None first.

    Each model gets an input leaf of its own, and FP8's graph is captured first. The
    gradients are set to None again afterwards, out of the graphs' memory. ``ahead``: FP8's
    forward runs in a ``fp8state.cast_weights_ahead`` block.
    """
    steps = [
        make_step(models[fp8], x.detach().clone().requires_grad_(), grad, fp8, True, ahead and fp8)
        for fp8 in (True, False)
    ]
    fp8_graph = graphed(steps[0])
    ratio = _pair(fp8_graph, graphed(steps[1]), device, args)
    for model in models.values():
        model.zero_grad(set_to_none=True)
    return ratio


def _graphed_layers(
    x: torch.Tensor, grad: torch.Tensor, device: torch.device, args, microbatches: int = 0
) -> float:
    """Each layer graphed on its own: fp8state.make_graphed_callables against torch's.

    ``microbatches``: fp8state's graphs cache FP8 weights (``fp8_weight_caching``) and each
    call is one micro-batch of that many per optimizer step (only the first casts weights).
    """
    steps = {}
    for fp8 in (True, False):
        model = build_model(fp8, device, **args.model)
        samples, h = [], x.detach()
        for block in model:
            samples.append((h.clone().requires_grad_(),))
            with torch.no_grad():
                h = block(h)
        if fp8:
            caching = microbatches > 0
            fp8state.make_graphed_callables(
                tuple(model), tuple(samples), fp8_weight_caching=caching
            )
        else:
            torch.cuda.make_graphed_callables(tuple(model), tuple(samples))
        # The graphs hold their FP8 settings: no fp8_autocast around the calls.
        steps[fp8] = (
            _microbatch_step(model, x, grad, microbatches)
            if fp8 and microbatches
            else make_step(model, x, grad, fp8=False)
        )
    return _pair(steps[True], steps[False], device, args)


def _microbatch_step(
    model: nn.Sequential, x: torch.Tensor, grad: torch.Tensor, per_step: int
) -> Callable[[], None]:
    """One fwd+bwd micro-batch per call; the first of every ``per_step`` casts the weights."""
    calls = itertools.count()

    def step() -> None:
        first = next(calls) % per_step == 0
        h = x
        for block in model:
            h = block(h, is_first_microbatch=first)
        h.backward(grad)

    return step


def compile_counts(step: Callable[[], None]) -> dict[str, int]:
    """Dynamo's graph breaks and recompilations over 20 compiled steps.

    A recompilation is a compilation of a frame (one code object, as dynamo counts them) past
    its first: dynamo's own per-frame count, ``convert_frame.FRAME_COMPILE_COUNTER``, a
    private table read here because no public counter exists. Frames past the recompile
    limit run eagerly and compile no more, so the first step's count matters as much as the
    later steps'.
    """
    from torch._dynamo import convert_frame
    from torch._dynamo.utils import counters

    counters.clear()
    before = dict(convert_frame.FRAME_COMPILE_COUNTER)

    def recompiles() -> int:
        now = convert_frame.FRAME_COMPILE_COUNTER
        return sum(
            n - before.get(f, 0) - (0 if f in before else 1)
            for f, n in now.items()
            if n > before.get(f, 0)
        )

    step()
    first = recompiles()
    for _ in range(COMPILED_STEPS - 1):
        step()
    return {
        "compile_graph_breaks": sum(counters["graph_break"].values()),
        "compile_recompiles": recompiles(),
        "compile_recompiles_after_first_step": recompiles() - first,
        "compile_frames": counters["frames"]["total"],
    }


def guarded(fn: Callable):
    try:
        return fn()
    except Exception as exc:  # a mode that fails is a result too
        traceback.print_exc()
        first_line = (str(exc).splitlines() or [""])[0]  # an assert may carry no message
        return f"error: {type(exc).__name__}: {first_line[:200]}"


def bench_host(device: torch.device, args) -> dict[str, float | None]:
    """Host time per FP8 Linear step over nn.Linear's: fp8state's, and the floor's."""
    if device.type != "cuda":
        return {"host_overhead_ratio": None, "host_floor_ratio": None}
    from host_overhead import build, host_us

    m, k, n = args.host_shape
    bf16_us = host_us(build(m, k, n, False))
    return {
        "host_overhead_ratio": round(host_us(build(m, k, n, True)) / bf16_us, 3),
        "host_floor_ratio": round(host_us(floor_step(m, k, n, device)) / bf16_us, 3),
    }


def main(argv: list[str] | None = None) -> dict:
    """Run every part and return (and print, and merge into ``--out``) the keys."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, to test the script")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip", nargs="*", default=[], choices=["sweep", "model", "host"])
    parser.add_argument(
        "--shapes", nargs="*", default=None, help="sweep only these MxKxN (default: all twelve)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.warmup, args.blocks = (1, 2) if args.quick else (5, 10)
    args.sweep = [(64, 32, 32)] if args.quick else SWEEP
    if args.shapes:
        args.sweep = [tuple(int(d) for d in shape.split("x")) for shape in args.shapes]
    args.model = {"layers": 2, "hidden": 64, "ffn": 128, "heads": 4} if args.quick else {}
    args.tokens = 32 if args.quick else 2048
    args.host_shape = HOST_SHAPE
    spin_up(device, 0.0 if args.quick else 2.0)
    started = time.perf_counter()
    result: dict = {}
    if "sweep" not in args.skip:
        result.update(bench_sweep(device, args))
    if "model" not in args.skip:
        result["model_h2048_speedup"], counts = bench_model(device, args)
        result.update(counts)
    if "host" not in args.skip:
        result.update(bench_host(device, args))
    result["training_loop_run"] = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none",
        "seconds": round(time.perf_counter() - started, 1),
        "command": "python benchmarks/training_loop.py"
        + (" --quick" if args.quick else "")
        + (" --skip " + " ".join(args.skip) if args.skip else "")
        + (" --shapes " + " ".join(args.shapes) if args.shapes else ""),
    }
    report(result, args.out)
    return result


if __name__ == "__main__":
    main()
