"""The replay node's contract with autograd, on the CPU: graphs that stand in for CUDA graphs
(a CPU cannot capture one) write their static buffers as a replay would, so what the node
hands autograd can be checked. Real captures: tests/gpu/test_make_graphed_callables.py."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

import fp8state
from fp8state.autocast import FP8Context
from fp8state.graphs._capture import Captured, Graphs
from fp8state.graphs._graphed import GraphedForward


class _Graph:
    """Replays ``work`` on the static buffers, as a captured graph rewrites them."""

    def __init__(self) -> None:
        self.work = lambda: None

    def replay(self) -> None:
        self.work()


def _doubling(param: torch.nn.Parameter) -> tuple[torch.nn.Module, Captured]:
    """A module ``y = 2 * x * p`` whose 'graphs' write fresh results into fixed buffers."""
    module = torch.nn.Module()
    module.p = param
    x_in, y_out = torch.zeros(4, requires_grad=True), torch.zeros(4)
    grad_out, grad_x, grad_p = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    fwd, bwd = _Graph(), _Graph()
    fwd.work = lambda: y_out.copy_(2 * x_in.detach() * param.detach())
    bwd.work = lambda: (
        grad_x.copy_(2 * param.detach() * grad_out),
        grad_p.copy_(2 * x_in.detach() * grad_out),
    )
    spec = pytree.tree_flatten((y_out,))[1]
    cap = Captured(fwd, bwd, (x_in,), (param,), (y_out,), spec, (grad_out,), (grad_x, grad_p))  # type: ignore[arg-type]
    return module, cap


def test_gradients_accumulate_over_replays_as_over_eager_calls() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    module, cap = _doubling(param)
    ctx = FP8Context(
        enabled=True, calibrating=False, recipe=fp8state.DelayedScaling(), group=None,
        gemm_backend="auto",
    )  # fmt: skip
    graphed = GraphedForward(0, module, None, Graphs(cap), ctx, [], [])
    xs = [torch.full((4,), float(i + 1), requires_grad=True) for i in range(3)]
    total = 0.0
    for x in xs:  # three micro-batches, no optimizer step in between
        (y,) = graphed(x)
        y.sum().backward()
        total += 2 * x[0].item()
        # The sum so far: the first gradient kept is not the buffer later replays rewrite.
        assert torch.equal(param.grad, torch.full((4,), total))
    for x in xs:  # leaf inputs keep their own gradients too
        assert torch.equal(x.grad, torch.full((4,), 2.0))
