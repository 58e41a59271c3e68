"""Warm-up and capture: each module's forward and backward as two CUDA graphs, FP8 step included.

A forward runs under its own ``fp8_autocast``, whose exit updates the forward scales; the
backward is one ``torch.autograd.grad`` pass, whose end updates the backward scales. Both
happen inside the captures, so a replay is a whole FP8 step: casts, amax records, history
shift, (reduction and) scale update. The warm-up steps that must precede a capture change the
FP8 metadata; it is put back afterwards, so the first replay starts where the model was.

With FP8 weight caching, each module gets two sets of graphs: the first micro-batch's, which
casts the weights and keeps the FP8 copies in tensors the graph owns, and the later
micro-batches', which reads those copies and casts no weight.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fp8state import autocast
from fp8state._runtime import amax_reduction, microbatch, snapshot
from fp8state._runtime.friend import set_plain_attr
from fp8state.mixin import FP8StateMixin

__all__ = ["Captured", "Graphs", "capture_all", "fp8_modules_of", "positional", "run_under"]


@dataclass
class Captured:
    """One module's graphs and the static tensors they read and write."""

    fwd_graph: torch.cuda.CUDAGraph
    bwd_graph: torch.cuda.CUDAGraph
    static_inputs: tuple[torch.Tensor, ...]
    params: tuple[nn.Parameter, ...]
    static_outputs: tuple[torch.Tensor, ...]
    out_spec: Any
    static_grad_outputs: tuple[torch.Tensor | None, ...]
    static_grad_inputs: tuple[torch.Tensor | None, ...]


#: One FP8 module's weight-cache entries (``{gemm: (fp8, fp8 transpose, inverse scale)}``).
CachedWeights = tuple[tuple[FP8StateMixin, dict[int, Any]], ...]


@dataclass
class Graphs:
    """A module's graphs: one set, or with FP8 weight caching one per kind of micro-batch.

    Attributes:
        first: Without caching, every call's graphs; with it, the first micro-batch's (they
            cast the weights and write the FP8 copies into ``weights``' tensors).
        later: With caching, the later micro-batches' graphs (they read those copies and cast
            no weight); None without.
        weights: With caching, per FP8 module of the callable, the weight-cache entries
            ``first`` writes and ``later`` reads; empty without.
    """

    first: Captured
    later: Captured | None = None
    weights: CachedWeights = ()


def fp8_modules_of(module: nn.Module) -> list[FP8StateMixin]:
    """The FP8 modules in ``module`` (itself included), in ``modules()`` order."""
    return [m for m in module.modules() if isinstance(m, FP8StateMixin)]


def positional(forward: Any, n_args: int, kwarg_names: Sequence[str]) -> Any:
    """``forward`` called with its keyword tensors after its positional ones, in one tuple.

    Capture and replay handle a module's inputs as one flat tuple of static tensors; this
    hands the last ``len(kwarg_names)`` of them back to ``forward`` by name.
    """
    if not kwarg_names:
        return forward

    def call(*flat: torch.Tensor) -> Any:
        named = dict(zip(kwarg_names, flat[n_args:], strict=True))
        return forward(*flat[:n_args], **named)

    return call


def run_under(ctx: autocast.FP8Context, call: Any) -> Any:
    """``call()`` inside a new ``fp8_autocast`` with ``ctx``'s settings."""
    with autocast.fp8_autocast(
        enabled=ctx.enabled,
        calibrating=ctx.calibrating,
        fp8_recipe=ctx.recipe,
        fp8_group=ctx.group,
        gemm_backend=ctx.gemm_backend,
    ):
        return call()


def _run(forward: Any, ctx: autocast.FP8Context, args: Sequence[torch.Tensor]) -> Any:
    return run_under(ctx, lambda: forward(*args))


def _surface(args: Sequence[torch.Tensor], params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """What a backward differentiates against: inputs, then parameters, that need gradients."""
    return [t for t in (*args, *params) if t.requires_grad]


def _backward(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    surface: Sequence[torch.Tensor],
    allow_unused: bool,
) -> tuple[torch.Tensor | None, ...]:
    needing = [o for o in outputs if o.requires_grad]
    if not needing or not surface:
        return ()
    return torch.autograd.grad(
        needing, surface, grad_outputs, only_inputs=True, allow_unused=allow_unused
    )


def capture_all(
    forwards: Sequence[Any],
    modules: Sequence[nn.Module],
    sample_args: Sequence[tuple[torch.Tensor, ...]],
    ctx: autocast.FP8Context,
    warmup: int,
    allow_unused: bool,
    pool: Any,
    weight_caching: bool = False,
) -> tuple[list[Graphs], list[Any]]:
    """Warm up, capture every forward in order and every backward in reverse, restore FP8 state.

    With ``weight_caching``, all that twice: the first micro-batch's graphs in ``pool``, then
    the later micro-batches' in a pool of their own (modules may mix the two kinds in one
    pass, so their temporaries must not share memory). A failure leaves the modules as they
    were: FP8 metadata, recipe, weight caches and ``fp8_graphed`` put back (buffers grown for
    a longer window stay grown).

    Returns the graphs and the pointer tables of the batched scale update that the graphs
    may read (the caller keeps them alive: the cache that made them may drop them later).
    """
    fp8 = [m for module in modules for m in fp8_modules_of(module)]
    before = [(m.fp8_graphed, m.fp8_recipe, dict(m.fp8_weight_cache)) for m in fp8]
    for m in fp8:
        if ctx.enabled or ctx.calibrating:
            # The graphs' recipe now, as the warm-up's scale update would make it: a longer
            # window grows the buffers here, before the snapshot and the capture take them.
            m.fp8_recipe = ctx.recipe
        # Graphed from the warm-up on: the FP8-or-not decision of every GEMM is the graphs'
        # own (fp8state.backends.GRAPHED_MIN_GEMM_MACS); the warm-up runs what is captured.
        set_plain_attr(m, "fp8_graphed", True)
    saved = snapshot.take(fp8)
    params = [tuple(m.parameters()) for m in modules]
    flags: tuple[bool | None, ...] = (True, False) if weight_caching else (None,)
    captured: dict[bool | None, list[Captured]] = {}
    try:
        with _collector_paused(), amax_reduction.tables_kept() as tables:
            for flag in flags:
                with microbatch.assumed(flag):
                    _warm_up(forwards, sample_args, params, ctx, warmup, allow_unused)
            for flag in flags:
                where = torch.cuda.graph_pool_handle() if flag is False else pool
                with microbatch.assumed(flag):
                    captured[flag] = _capture(
                        forwards, sample_args, params, ctx, allow_unused, where
                    )
    except BaseException:
        for m, (graphed, recipe, cache) in zip(fp8, before, strict=True):
            set_plain_attr(m, "fp8_graphed", graphed)
            m.fp8_recipe = recipe  # grown buffers stay: a shorter window fits them
            m.fp8_weight_cache.clear()  # the copies the module had, none a graph may write
            m.fp8_weight_cache.update(cache)
        with contextlib.suppress(Exception):  # the metadata as it was, where CUDA still can
            snapshot.put_back(saved)
        raise
    snapshot.put_back(saved)
    if not weight_caching:
        return [Graphs(c) for c in captured[None]], tables
    graphs = [
        Graphs(first, later, tuple((m, dict(m.fp8_weight_cache)) for m in fp8_modules_of(module)))
        for first, later, module in zip(captured[True], captured[False], modules, strict=True)
    ]
    for m in fp8:  # the captured copies hold nothing until the first micro-batch's replay
        m.fp8_weight_cache.clear()
    return graphs, tables


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector run once now, then paused until the block ends.

    A CUDA graph that the collector frees while a stream is capturing destroys its executable
    graph, which CUDA forbids during a capture: the capture being made fails, and the process's
    CUDA state with it. Dead reference cycles holding graphs (an earlier graphed model, say)
    are common, and ``torch.cuda.graph`` no longer collects before capturing by default.
    """
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


_Args = Sequence[tuple[torch.Tensor, ...]]
_Params = Sequence[tuple[nn.Parameter, ...]]


def _warm_up(
    forwards: Sequence[Any],
    sample_args: _Args,
    params: _Params,
    ctx: autocast.FP8Context,
    warmup: int,
    allow_unused: bool,
) -> None:
    """Eager steps on a side stream: kernels compiled, workspaces and pointer tables made."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for forward, args, ps in zip(forwards, sample_args, params, strict=True):
            for _ in range(warmup):
                outs = pytree.tree_leaves(_run(forward, ctx, args))
                zeros = [torch.zeros_like(o) for o in outs if o.requires_grad]
                _backward(outs, zeros, _surface(args, ps), allow_unused)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _capture(
    forwards: Sequence[Any],
    sample_args: _Args,
    params: _Params,
    ctx: autocast.FP8Context,
    allow_unused: bool,
    pool: Any,
) -> list[Captured]:
    """Forwards in order, then backwards in reverse: the order they run in, in one pool."""
    fwd_graphs = [torch.cuda.CUDAGraph() for _ in forwards]
    bwd_graphs = [torch.cuda.CUDAGraph() for _ in forwards]
    outputs, specs = [], []
    for forward, args, graph in zip(forwards, sample_args, fwd_graphs, strict=True):
        with torch.cuda.graph(graph, pool=pool):
            out = _run(forward, ctx, args)
        flat, spec = pytree.tree_flatten(out)
        outputs.append(tuple(flat))
        specs.append(spec)
    captured: list[Captured] = []
    for i in reversed(range(len(forwards))):
        static_grads = tuple(torch.empty_like(o) if o.requires_grad else None for o in outputs[i])
        surface = _surface(sample_args[i], params[i])
        with torch.cuda.graph(bwd_graphs[i], pool=pool):
            grads = _backward(
                outputs[i], [g for g in static_grads if g is not None], surface, allow_unused
            )
        found = iter(grads)  # aligned with surface: the inputs that need gradients
        per_input = tuple(
            next(found, None) if t.requires_grad else None for t in (*sample_args[i], *params[i])
        )
        captured.append(
            Captured(
                fwd_graphs[i],
                bwd_graphs[i],
                sample_args[i],
                params[i],
                outputs[i],
                specs[i],
                static_grads,
                per_input,
            )
        )
    captured.reverse()
    torch.cuda.synchronize()
    return captured
