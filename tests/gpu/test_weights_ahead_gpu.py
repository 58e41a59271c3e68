"""``cast_weights_ahead`` on a GPU: real FP8 GEMMs and Triton casts, eager and graphed.

CUDA only. Steps whose weights were cast ahead compute, record and learn exactly what the
plain steps do, bit for bit, eagerly and with the whole step (the block included) captured in
one CUDA graph and replayed between optimizer updates of the weights.
"""

from __future__ import annotations

import pytest
import torch
from _helpers.capture import warm_up
from torch import nn

import fp8state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

H, TOKENS = 512, 256


def _model() -> nn.Sequential:
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    model = nn.Sequential(
        fp8state.LayerNormLinear(H, 2 * H, **kw),
        fp8state.Linear(2 * H, H, **kw),
        fp8state.LayerNormMLP(H, 2 * H, **kw),
    )
    for m in model:
        m.fp8_min_gemm_macs = 0  # FP8 at this size too
    return model


def _twins() -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    a, b = _model(), _model()
    b.load_state_dict(a.state_dict())
    return a, b


def _step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, ahead: bool) -> torch.Tensor:
    for p in [*model.parameters(), x]:
        p.grad = None
    with fp8state.fp8_autocast():
        with fp8state.cast_weights_ahead(model if ahead else [], tokens=TOKENS):
            y = model(x)
    y.backward(grad)
    return y


def _update(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.01 * p.grad)  # in place: a graph reads the same storage


def _assert_same(a: nn.Module, b: nn.Module, ya: torch.Tensor, yb: torch.Tensor, step: int) -> None:
    assert torch.equal(ya, yb), step
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), (step, name)
    for (name, t), u in zip(a.named_buffers(), b.buffers(), strict=True):
        assert torch.equal(t, u), (step, name)


def test_eager_steps_cast_ahead_are_the_plain_steps() -> None:
    plain, ahead = _twins()
    grad = torch.randn(TOKENS, H, device="cuda", dtype=torch.bfloat16)
    for step in range(4):
        x = torch.randn(TOKENS, H, device="cuda", dtype=torch.bfloat16) * (step + 1)
        ya = _step(plain, x.clone().requires_grad_(), grad, False)
        yb = _step(ahead, x.clone().requires_grad_(), grad, True)
        _assert_same(plain, ahead, ya, yb, step)
        assert ahead[1].fp8_last_gemm_backend == plain[1].fp8_last_gemm_backend != "high_precision"
        _update(plain)
        _update(ahead)


def test_a_captured_step_cast_ahead_replays_the_plain_eager_steps() -> None:
    captured, eager = _twins()
    grad = torch.randn(TOKENS, H, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(TOKENS, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pairs = ((captured, True), (eager, False))
    # Warm-up steps (kernels compiled, workspaces made); both twins take the same ones.
    warm_up(lambda: [_step(m, x, grad, ahead) for _ in range(3) for m, ahead in pairs])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _step(captured, x, grad, True)
    for replay in range(4):
        with torch.no_grad():
            x.copy_(torch.randn_like(x) * (replay + 1))
        y_eager = _step(eager, x.detach().clone().requires_grad_(), grad, False)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(captured, eager, y, y_eager, replay)
        _update(captured)
        _update(eager)
