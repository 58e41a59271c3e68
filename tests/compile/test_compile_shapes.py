"""Compiled steps over batches of varying length: Dynamo's dynamic shapes, eager's numbers.

Language-model batches padded to their own longest sequence change length every step. After
the second length, Dynamo compiles one graph with the length symbolic, and it must serve every
later length, bit for bit with eager (``aot_eager``). Whether a GEMM runs in FP8 depends on its
size (``fp8_min_gemm_macs``), so that decision is a guard on the symbolic length: one graph per
set of decisions, and none compiled again once each has been seen.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.testing
from torch import nn

import fp8state

LENGTHS = [8, 12, 16, 20, 24, 9]
#: The FP8 threshold: the GEMMs of 32 -> 48 and 48 -> 32 features (3072 MACs per token of a
#: batch of two rows) switch to FP8 between 12 and 16 tokens, the MLP's (4096) at 11 tokens,
#: so lengths up to 9, 12 and 13, and 16 on lead to three sets of decisions.
THRESHOLD = 3072 * 14


def _twins(threshold: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(
        fp8state.LayerNormLinear(32, 48), fp8state.Linear(48, 32), fp8state.LayerNormMLP(32, 64)
    )
    for module in model:
        module.fp8_min_gemm_macs = threshold
    return model, copy.deepcopy(model)


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with fp8state.fp8_autocast():
        y = model(x)
    y.pow(2).sum().backward()
    return y.detach()


def _run(
    model: nn.Module, twin: nn.Module, compiled: nn.Module, lengths: list[int]
) -> list[list[str]]:
    gen = torch.Generator().manual_seed(1)
    backends = []
    for tokens in lengths:
        x = torch.randn(2, tokens, 32, generator=gen)
        assert torch.equal(_step(compiled, x), _step(twin, x)), tokens
        for (key, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
            assert torch.equal(a, b), (tokens, key)
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), tokens
        backends.append([m.fp8_last_gemm_backend for m in model])
        assert backends[-1] == [m.fp8_last_gemm_backend for m in twin]
    return backends


@pytest.mark.parametrize("threshold", [0, THRESHOLD])
def test_varying_lengths_compile_a_dynamic_graph_per_decision(threshold: int) -> None:
    model, twin = _twins(threshold)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    backends = _run(model, twin, compiled, LENGTHS)
    # The first length's static graph, then a dynamic one per set of FP8 decisions.
    assert counter.frame_count == 1 + len({tuple(b) for b in backends[1:]})
    if threshold:
        assert backends[0] == ["high_precision"] * 3 and backends[2] == ["emulated"] * 3
    with torch._dynamo.config.patch(error_on_recompile=True):  # every length seen: no more
        _run(model, twin, compiled, [10, 22, 13])
