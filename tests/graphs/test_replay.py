"""The replay node's contract with autograd, on the CPU: graphs that stand in for CUDA graphs
(a CPU cannot capture one) write their static buffers as a replay would, so what the node
hands autograd can be checked. Real captures: tests/gpu/test_make_graphed_callables.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import fp8state
from fp8state.autocast import FP8Context
from fp8state.errors import ConfigError
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


def _graphed(param: torch.nn.Parameter, caching: bool = False) -> GraphedForward:
    module, cap = _doubling(param)
    # With caching, a second set of 'graphs' for later micro-batches, as capture makes one.
    later = _doubling(param)[1] if caching else None
    ctx = FP8Context(
        enabled=True, calibrating=False, recipe=fp8state.DelayedScaling(), group=None,
        gemm_backend="auto",
    )  # fmt: skip
    return GraphedForward(0, module, None, Graphs(cap, later), ctx, [], [])


def test_gradients_accumulate_over_replays_as_over_eager_calls() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    graphed = _graphed(param)
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


def test_a_backward_whose_saved_state_a_later_forward_rewrote_raises() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    graphed = _graphed(param)
    x1, x2 = torch.full((4,), 1.0, requires_grad=True), torch.full((4,), 5.0, requires_grad=True)
    (y1,) = graphed(x1)
    (y2,) = graphed(x2)  # a second call in flight: the graph now holds its saved state
    with pytest.raises(ConfigError, match="backward of forward call 1, after forward call 2"):
        y1.sum().backward()
    assert param.grad is None  # nothing handed to autograd
    y2.sum().backward()  # the last call's backward is exact
    assert torch.equal(param.grad, torch.full((4,), 10.0))
    (y3,) = graphed(x1)  # a forward whose backward never runs is no error
    (y4,) = graphed(x2)
    y4.sum().backward()
    assert torch.equal(param.grad, torch.full((4,), 20.0))


def test_a_call_of_either_kind_in_flight_makes_the_earlier_backward_raise() -> None:
    # Both kinds of micro-batch share the module's static inputs and cached FP8 weights.
    param = torch.nn.Parameter(torch.ones(4))
    graphed = _graphed(param, caching=True)
    x1, x2 = torch.full((4,), 1.0, requires_grad=True), torch.full((4,), 5.0, requires_grad=True)
    (y1,) = graphed(x1, is_first_microbatch=True)
    (y2,) = graphed(x2, is_first_microbatch=False)
    with pytest.raises(ConfigError, match="backward of forward call 1, after forward call 2"):
        y1.sum().backward()
    y2.sum().backward()
    assert torch.equal(param.grad, torch.full((4,), 10.0))


def test_a_leaf_reached_through_a_view_or_a_sum_keeps_its_own_gradient() -> None:
    param = torch.nn.Parameter(torch.ones(4))
    graphed = _graphed(param)
    leaf = torch.full((2, 2), 1.0, requires_grad=True)
    bias = torch.zeros(4, requires_grad=True)
    for step in range(1, 4):
        (y,) = graphed(leaf.view(4) + bias)  # both backwards pass the gradient on as it is
        y.sum().backward()
        assert torch.equal(leaf.grad, torch.full((2, 2), 2.0 * step)), step
        assert torch.equal(bias.grad, torch.full((4,), 2.0 * step)), step
