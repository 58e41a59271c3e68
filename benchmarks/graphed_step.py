"""The whole graphed step of the 16-layer model against bf16's, a few times in one process.

Usage (CUDA): ``python benchmarks/graphed_step.py [TAG] [--repeats 3]``.

``training_loop.py``'s ``graphed_1x2048`` alone, without the rest of that run: one fwd+bwd
of ``transformer.py``'s model at 1 x 2048 tokens captured whole in one CUDA graph
(``training_loop.graphed``; fp8state's layers marked ``fp8_graphed``, every GEMM in FP8)
against the bf16 model's graph, timed by ``hopper.steady_pair_ms`` (5 warm-up blocks, 10
timed) ``--repeats`` times. Meant for A/B runs of two copies of the library, alternated in
separate processes (``PYTHONPATH=<copy> python benchmarks/graphed_step.py base``): each line
prints the TAG, both times and the ratio.
"""

from __future__ import annotations

import argparse
import json

import torch
from hopper import spin_up, steady_pair_ms  # benchmarks/ is on sys.path as a script
from training_loop import graphed
from transformer import MODEL, build_model, make_step, mark_graphed

import fp8state


def main() -> None:
    """Capture both steps, then print ``--repeats`` timed pairs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag", nargs="?", default="")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    spin_up(device, 2.0)
    x = torch.randn(1, 2048, MODEL["hidden"], device=device, dtype=torch.bfloat16)
    x.requires_grad_()
    grad = torch.randn_like(x)
    fp8_model = build_model(True, device)
    mark_graphed(fp8_model, True)  # captured by hand: the modules say so
    fp8 = graphed(make_step(fp8_model, x, grad, True))
    bf16 = graphed(make_step(build_model(False, device), x, grad, False))
    print("library:", fp8state.__file__, flush=True)
    for _ in range(args.repeats):
        bf16_ms, fp8_ms = steady_pair_ms(bf16, fp8, device, 5, 10)
        row = {"tag": args.tag, "bf16_ms": round(bf16_ms, 3), "fp8_ms": round(fp8_ms, 3)}
        print(json.dumps({**row, "ratio": round(bf16_ms / fp8_ms, 3)}), flush=True)


if __name__ == "__main__":
    main()
