"""FP8 weights cached across micro-batches (``is_first_microbatch``), eager and compiled.

Usage (CUDA): ``python benchmarks/compiled_microbatches.py [--modes ...] [--out
benchmarks/results/h200.json]``.

One optimizer step of the 16-layer model (``transformer.py``) as ``--micro-batches`` fwd+bwd
passes of 1 x ``--tokens`` tokens, each under its own ``fp8_autocast``, every GEMM in FP8
(the graphed threshold, so that there are FP8 weights to cache). Timed in steady state
(``hopper.steady_pair_ms``), per mode (eager; compiled in Inductor's default mode): the step
with the weights cast in every micro-batch (no ``is_first_microbatch``) against the step that
casts them in the first and reuses the cached copies after (True, then False). Compiled,
the graph gets copies of the cached tensors (docs/compile.md). Mode ``eager_ahead``: the
cached step is one ``fp8_autocast`` around all the micro-batches with their forwards in a
``fp8state.cast_weights_ahead`` block (every weight cast before the first micro-batch, no
argument passed), against the same uncached step. Records ``microbatch_caching_1x2048``:
per mode, time without caching / time with (above 1: caching pays), and both times in ms.
``--modes`` runs only those modes (the eager ones take seconds, the compiled one minutes to
compile). ``--quick`` (tiny model, CPU too) tests the script.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from hopper import spin_up, steady_pair_ms  # benchmarks/ is on sys.path as a script
from record import report
from transformer import build_model, mark_graphed

import fp8state

# Each mode, and whether its layers run compiled.
MODES = {"eager": False, "eager_ahead": False, "compiled": True}


def _layers(model: torch.nn.Module, x: torch.Tensor, first: bool | None) -> torch.Tensor:
    for block in model:
        x = block(x, first)
    return x


def _step(
    run: Callable[..., torch.Tensor],
    model: torch.nn.Module,
    xs: list[torch.Tensor],
    grad: torch.Tensor,
    cached: bool,
) -> Callable[[], None]:
    """One optimizer step's micro-batches (no optimizer: the weights stay, as caching needs)."""

    def step() -> None:
        for m, x in enumerate(xs):
            with fp8state.fp8_autocast():
                y = run(model, x, (m == 0) if cached else None)
            y.backward(grad)
        model.zero_grad(set_to_none=True)

    return step


def _ahead_step(
    model: torch.nn.Module, xs: list[torch.Tensor], grad: torch.Tensor
) -> Callable[[], None]:
    """The micro-batches of :func:`_step` under one ``fp8_autocast``, weights cast ahead."""
    tokens = xs[0].shape[:-1].numel()

    def step() -> None:
        with fp8state.fp8_autocast(), fp8state.cast_weights_ahead(model, tokens=tokens):
            for x in xs:
                _layers(model, x, None).backward(grad)
        model.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks of 10 steps")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="tiny model, to test the script")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = {"layers": 2, "hidden": 64, "ffn": 128, "heads": 4} if args.quick else {}
    tokens = 16 if args.quick else args.tokens
    model = build_model(True, device, **shape)
    mark_graphed(model, True)  # every GEMM in FP8
    hidden = shape.get("hidden", 2048)
    gen = torch.Generator(device=device).manual_seed(0)
    xs = [
        torch.randn(1, tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
        for _ in range(args.micro_batches)
    ]
    grad = torch.randn_like(xs[0])
    spin_up(device, 0 if args.quick else 5)
    result: dict[str, dict[str, float]] = {}
    for mode in args.modes:
        run = torch.compile(_layers) if MODES[mode] else _layers
        every = _step(run, model, xs, grad, cached=False)
        cached = (
            _ahead_step(model, xs, grad)
            if mode == "eager_ahead"
            else _step(run, model, xs, grad, cached=True)
        )
        warmup, blocks = (1, 1) if args.quick else (3, args.blocks)
        t_every, t_cached = steady_pair_ms(every, cached, device, warmup, blocks)
        result[mode] = {
            "ratio": round(t_every / t_cached, 3),
            "every_micro_batch_ms": round(t_every, 3),
            "cached_ms": round(t_cached, 3),
        }
    key = f"microbatch_caching_{'quick' if args.quick else f'1x{tokens}'}"
    command = "python benchmarks/compiled_microbatches.py" + (" --quick" if args.quick else "")
    if args.modes != list(MODES):
        command += " --modes " + " ".join(args.modes)
    out = {key: {"command": command, "micro_batches": args.micro_batches, **result}}
    report(out, args.out)
    return out


if __name__ == "__main__":
    main()
