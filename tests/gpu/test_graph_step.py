"""A whole FP8 training step captured in a CUDA graph replays like eager steps, bit for bit.

CUDA only. CUDA graphs remove the host's launch time from every step, which matters for models
of many small layers (docs/benchmarks.md). A captured step must not bake in buffers shared
with other launches, and the history shift, the amax records and the scale update must all
run on every replay: one module is captured, its twin (same parameters and metadata) runs
the same steps eagerly, and outputs, gradients and FP8 metadata must agree after each replay.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _helpers.capture import warm_up
from torch import nn

import fp8state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODULES: dict[str, Callable[[], nn.Module]] = {
    "Linear": lambda: fp8state.Linear(512, 384, params_dtype=torch.bfloat16, device="cuda"),
    "LayerNormLinear": lambda: fp8state.LayerNormLinear(
        512, 384, params_dtype=torch.bfloat16, device="cuda"
    ),
    "LayerNormMLP": lambda: fp8state.LayerNormMLP(
        512, 1024, params_dtype=torch.bfloat16, device="cuda"
    ),
}


def _step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    with fp8state.fp8_autocast():
        y = module(x)
    y.backward(grad)
    return y


@pytest.mark.parametrize("name", sorted(MODULES))
def test_captured_step_replays_like_eager_steps(name: str) -> None:
    torch.manual_seed(0)
    captured, eager = MODULES[name](), MODULES[name]()
    for module in (captured, eager):
        module.fp8_min_gemm_macs = 0  # FP8 at this size too
    eager.load_state_dict(captured.state_dict())
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out_dim = 512 if name == "LayerNormMLP" else 384
    grad = torch.randn(256, out_dim, device="cuda", dtype=torch.bfloat16)
    # Warm-up steps (kernels compiled, cuBLAS workspaces made); both twins take the same ones.
    warm_up(lambda: [_step(m, x, grad) for _ in range(3) for m in (captured, eager)])
    for p in [*captured.parameters(), x]:
        p.grad = None  # replays write the gradients into the graph's own tensors
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _step(captured, x, grad)
    for replay in range(4):
        with torch.no_grad():
            x.copy_(torch.randn_like(x) * (replay + 1))
        x_eager = x.detach().clone().requires_grad_()
        for p in eager.parameters():
            p.grad = None
        y_eager = _step(eager, x_eager, grad)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, y_eager), replay
        assert torch.equal(x.grad, x_eager.grad), replay
        for (pname, p), q in zip(captured.named_parameters(), eager.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (replay, pname)
        for (bname, b), c in zip(captured.named_buffers(), eager.buffers(), strict=True):
            assert torch.equal(b, c), (replay, bname)
