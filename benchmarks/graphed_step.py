"""The whole graphed step of the 16-layer model against bf16's, a few times in one process.

Usage (CUDA): ``python benchmarks/graphed_step.py [TAG] [--repeats 3] [--fresh-grads]
[--ahead]``.

``training_loop.py``'s ``graphed_1x2048`` alone, without the rest of that run: one fwd+bwd
of ``transformer.py``'s model at 1 x 2048 tokens captured whole in one CUDA graph
(``training_loop.graphed``; fp8state's layers marked ``fp8_graphed``, every GEMM in FP8)
against the bf16 model's graph, timed by ``hopper.steady_pair_ms`` (5 warm-up blocks, 10
timed) ``--repeats`` times. The gradients accumulate from replay to replay, or with
``--fresh-grads`` are set to None before each capture (``transformer.clear_grads``), so the
graphs write them afresh, as a loop that zeroes its gradients the default way runs. Each model
has an input leaf of its own. ``--ahead``: fp8state's forward runs in a
``fp8state.cast_weights_ahead`` block (every weight cast before the first layer, inside the
graph). Meant for A/B runs of two copies of the library, alternated in
separate processes (``PYTHONPATH=<copy> python benchmarks/graphed_step.py base``): each line
prints the TAG, both times and the ratio.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

import torch
from hopper import spin_up, steady_pair_ms  # benchmarks/ is on sys.path as a script
from torch import nn
from training_loop import graphed
from transformer import MODEL, build_model, make_step, mark_graphed

import fp8state

FP8Step = Callable[[nn.Sequential, torch.Tensor, torch.Tensor, bool], Callable[[], None]]


def timed_pairs(fp8_step: FP8Step, label: dict[str, object], repeats: int, fresh: bool) -> None:
    """Capture ``fp8_step(model, x, grad, fresh)`` and bf16's step, print ``repeats`` pairs.

    ``fresh``: each step sets its gradients to None first. The FP8 model's layers are marked
    ``fp8_graphed`` (captured by hand: the modules say so); each step is captured whole in
    one CUDA graph, FP8's first, each with an input leaf of its own, and each printed JSON line
    starts with ``label``.
    """
    device = torch.device("cuda")
    spin_up(device, 2.0)
    x = torch.randn(1, 2048, MODEL["hidden"], device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    fp8_model = build_model(True, device)
    mark_graphed(fp8_model, True)
    fp8 = graphed(fp8_step(fp8_model, x.clone().requires_grad_(), grad, fresh))
    bf16_model = build_model(False, device)
    bf16 = graphed(make_step(bf16_model, x.clone().requires_grad_(), grad, False, fresh))
    print("library:", fp8state.__file__, flush=True)
    for _ in range(repeats):
        bf16_ms, fp8_ms = steady_pair_ms(bf16, fp8, device, 5, 10)
        row = {**label, "bf16_ms": round(bf16_ms, 3), "fp8_ms": round(fp8_ms, 3)}
        print(json.dumps({**row, "ratio": round(bf16_ms / fp8_ms, 3)}), flush=True)


def modules_step(
    model: nn.Sequential, x: torch.Tensor, grad: torch.Tensor, fresh: bool, ahead: bool = False
) -> Callable[[], None]:
    """The FP8 model's step as the modules run it (``ahead``: in a cast_weights_ahead block)."""
    return make_step(model, x, grad, True, fresh, ahead)


def main() -> None:
    """Time the model's graphed step as the modules run it, ``--repeats`` times."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag", nargs="?", default="")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fresh-grads", action="store_true")
    parser.add_argument("--ahead", action="store_true", help="weights cast ahead")
    args = parser.parse_args()
    label = {"tag": args.tag, "fresh_grads": args.fresh_grads, "ahead": args.ahead}
    step = functools.partial(modules_step, ahead=args.ahead)
    timed_pairs(step, label, args.repeats, args.fresh_grads)


if __name__ == "__main__":
    main()
