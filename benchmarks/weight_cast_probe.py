"""What the weight casts cost the graphed step, and whether moving them elsewhere helps.

Usage (CUDA + Triton): ``python benchmarks/weight_cast_probe.py VARIANT [--repeats 2]
[--fresh-grads] [--gaps] [--keep-copies]``, one variant per process.

The whole fwd+bwd of ``transformer.py``'s model at 1 x 2048 tokens captured in one CUDA graph
(``graphed_step.timed_pairs``; every GEMM in FP8; ``--fresh-grads``: gradients set to None
before each step, as there), timed against bf16's graph in the same process, with the 64
weight casts of a step (four per layer) done one way per variant:

- ``cast``: as the modules do them, each in its layer's forward (``graphed_step.py``'s step).
- ``cached``: none. The modules reuse the FP8 weights a first micro-batch cached
  (``is_first_microbatch=False``): the step without its weight casts.
- ``side``: ``cached``, plus the same 64 casts (each weight cast with its transpose, its amax
  recorded into the probe's own history) on a second stream, layer ``i`` waiting for its
  four: whether the casts hide under the GEMMs.
- ``grouped``: ``cached``, plus the 64 casts back to back before the forward, on the step's
  stream (the work of ``cast``, gathered).
- ``ahead``: the library's way to gather them, the forward in a ``fp8state.cast_weights_ahead``
  block (the casts record into the modules' own histories, whose steps the block opens
  first).
- ``direct``: ``cached``, plus the block's work done by hand inside the step's
  ``fp8_autocast``: every module's step opened (``open_steps``), then the 64 casts back to
  back into the modules' own histories and slots, by the kernel's launcher directly (not the
  modules' weight path, and the copies dropped unless ``--keep-copies``): between
  ``grouped`` and ``ahead``.

``grouped``, ``side`` and ``direct`` drop their casts' outputs (the modules multiply the
warm-up's copies), so inside the graph each cast can write where the one before it wrote, and
part of those bytes may never leave L2. ``--keep-copies`` holds them until the step's backward
has run, at addresses of their own, as the modules' casts (``cast``, ``ahead``) hold theirs.
On an H100 it changed nothing (docs/benchmarks.md).

``--gaps`` times the variant's FP8 graph alone against the sum of its kernels (:func:`gaps`):
how much of the step the GPU spends between kernels (not for ``side``, whose kernels overlap).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
from collections.abc import Callable

import torch
from graphed_step import timed_pairs  # benchmarks/ is on sys.path as a script
from hopper import kernel_ms, spin_up
from model_kernels import kernel_launches
from training_loop import graphed
from transformer import MODEL, build_model, clear_grads, mark_graphed

import fp8state
from fp8state._kernels import cast_launch
from fp8state._runtime.amax_reduction import open_steps
from fp8state.slots import FwdSlot, fwd_slot

VARIANTS = ("cast", "cached", "side", "grouped", "ahead", "direct")
KEEPS_COPIES = ("side", "grouped", "direct")  # the variants that drop their copies otherwise


def layer_weights(model: torch.nn.Sequential) -> list[list[torch.Tensor]]:
    """Each layer's four weights, in the order its forward casts them."""
    return [[b.qkv.weight, b.proj.weight, b.mlp.fc1_weight, b.mlp.fc2_weight] for b in model]


def weight_work(
    variant: str, weights: list[list[torch.Tensor]], kept: list | None
) -> list[Callable[[], None]]:
    """Per layer, the variant's casts of that layer's weights (none for four variants).

    Each is the modules' cast of a weight (with its transpose, a later record of a history),
    into scales and a history of the probe's own, so the modules' state stays as it was. The
    outputs go to ``kept`` (``--keep-copies``), or are dropped where it is None.
    """
    if variant in ("cast", "cached", "ahead", "direct"):
        return []
    device = weights[0][0].device
    states = [
        [(w, torch.ones(3, device=device), torch.ones(3, device=device)) for w in layer]
        for layer in weights
    ]
    history = torch.zeros(1024, 3, device=device)
    e4m3 = torch.float8_e4m3fn

    def casts(layer: list) -> None:
        for w, scale, scale_inv in layer:
            out = cast_launch.cast_slot(
                w, scale, scale_inv, history, 1, e4m3, transpose=True, new_step=False
            )
            if kept is not None:
                kept.append(out)

    return [functools.partial(casts, layer) for layer in states]


def direct_casts(model: torch.nn.Sequential, kept: list | None) -> None:
    """The block's opening and casts by hand: the modules' own histories, copies to ``kept``."""
    modules = [m for b in model for m in (b.qkv, b.proj, b.mlp)]
    open_steps("fwd", modules)
    for module in modules:
        hist, scale, scale_inv = module.fp8_meta("fwd")
        for gemm, w in enumerate(module.fp8_gemm_weights()):
            slot = fwd_slot(gemm, FwdSlot.WEIGHT)
            out = cast_launch.cast_slot(
                w, scale, scale_inv, hist, slot, torch.float8_e4m3fn, transpose=True, new_step=False
            )
            if kept is not None:
                kept.append(out)


def make_fp8_step(
    variant: str, model, x, grad, fresh: bool, keep: bool = False
) -> Callable[[], None]:
    """One fwd+bwd of ``model`` with the variant's weight work (``fresh``: grads set to None).

    ``keep``: the variant's own casts' outputs live until the step's backward has run.
    """
    kept: list | None = [] if keep else None
    work = weight_work(variant, layer_weights(model), kept)
    side = torch.cuda.Stream()
    calls = 0
    tokens = x.shape[:-1].numel()

    def step() -> None:
        nonlocal calls
        calls += 1
        # The first call (a warm-up, outside the graph) casts and caches the FP8 weights.
        first = None if variant in ("cast", "ahead") else calls == 1
        if fresh:
            clear_grads(model, x)
        events = []
        if variant == "side":
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for layer_work in work:
                    layer_work()
                    events.append(torch.cuda.Event())
                    events[-1].record(side)
        else:
            for layer_work in work:
                layer_work()
        ahead = (
            fp8state.cast_weights_ahead(model, tokens=tokens)
            if variant == "ahead"
            else contextlib.nullcontext()
        )
        with fp8state.fp8_autocast(), ahead:
            if variant == "direct":
                direct_casts(model, kept)
            h = x
            for i, block in enumerate(model):
                if events:
                    torch.cuda.current_stream().wait_event(events[i])
                h = block(h, is_first_microbatch=first)
        if variant == "side":
            torch.cuda.current_stream().wait_stream(side)
        h.backward(grad)
        if kept is not None:
            kept.clear()

    return step


def gaps(variant: str, fresh: bool, keep: bool) -> dict[str, object]:
    """The variant's FP8 step graphed, against the sum of its kernels: the graph's idle time.

    The kernels are profiled in an eager call of the step (``model_kernels.kernel_launches``,
    after its warm-up calls), then the step is captured and its replays timed back to back.
    """
    device = torch.device("cuda")
    spin_up(device, 2.0)
    x = torch.randn(1, 2048, MODEL["hidden"], device=device, dtype=torch.bfloat16)
    model = build_model(True, device)
    mark_graphed(model, True)
    x_leaf = x.clone().requires_grad_()
    step = make_fp8_step(variant, model, x_leaf, torch.randn_like(x), fresh, keep)
    launches = kernel_launches(step)
    kernels = sum(us for _, us in launches) / 1e3
    casts = [us for name, us in launches if name == "cast_kernel"]
    graph_ms = kernel_ms(graphed(step), device, 5, 20)
    return {
        "variant": variant,
        "fresh_grads": fresh,
        "keep_copies": keep,
        "graphed_ms": round(graph_ms, 3),
        "kernels_ms": round(kernels, 3),
        "idle_ms": round(graph_ms - kernels, 3),
        "launches": len(launches),
        "cast_kernels": len(casts),
        "cast_kernels_ms": round(sum(casts) / 1e3, 3),
    }


def main() -> None:
    """Time the variant's step against bf16's, ``--repeats`` times."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--fresh-grads", action="store_true")
    parser.add_argument(
        "--gaps", action="store_true", help="the FP8 graph's time against its kernels' instead"
    )
    parser.add_argument(
        "--keep-copies",
        action="store_true",
        help=f"{', '.join(KEEPS_COPIES)}: hold the casts' outputs until backward has run",
    )
    args = parser.parse_args()
    if args.gaps and args.variant == "side":
        parser.error("--gaps sums kernels on one stream; side runs two")
    if args.keep_copies and args.variant not in KEEPS_COPIES:
        parser.error(f"--keep-copies: {args.variant}'s copies are the modules' own, kept already")
    if args.gaps:
        print(json.dumps(gaps(args.variant, args.fresh_grads, args.keep_copies)), flush=True)
        return
    step = functools.partial(make_fp8_step, args.variant, keep=args.keep_copies)
    label = {
        "variant": args.variant,
        "fresh_grads": args.fresh_grads,
        "keep_copies": args.keep_copies,
    }
    timed_pairs(step, label, args.repeats, args.fresh_grads)


if __name__ == "__main__":
    main()
