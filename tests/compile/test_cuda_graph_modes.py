"""fp8state's operators under Inductor's CUDA graphs (``mode="reduce-overhead"``).

The casts' Python must run at every step, and the FP8 operands they make live at new
addresses every step; so every operator that makes or multiplies them stays outside
Inductor's CUDA graphs, and no CUDA graph takes an FP8 operand as a static input (torch
would record such a graph again at every step instead of replaying it:
tests/gpu/test_compile_gpu.py counts the recordings). On the CPU there are no CUDA graphs:
compiling in that mode runs the casts as the default mode does.
"""

from __future__ import annotations

import pytest
import torch

import fp8state
from fp8state._runtime.context_stack import TAGS  # its module defines autocast_exit
from fp8state.functional import _ops  # noqa: F401  (defines the other operators)

UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)


@pytest.mark.skipif(UNSAFE is None, reason="this torch has no cudagraph_unsafe tag")
def test_the_operators_tags_hold_the_tag() -> None:
    assert UNSAFE in TAGS


@pytest.mark.skipif(UNSAFE is None, reason="this torch has no cudagraph_unsafe tag")
@pytest.mark.parametrize("name", ["cast_slot", "record_amax", "gemm", "autocast_exit"])
def test_operators_on_fp8_operands_stay_out_of_cuda_graphs(name: str) -> None:
    assert UNSAFE in getattr(torch.ops.fp8state, name).default.tags


def test_compiling_cpu_casts_in_reduce_overhead_mode_runs_them() -> None:
    torch._dynamo.reset()
    layer = fp8state.Linear(32, 32)
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    with fp8state.fp8_autocast():
        y = compiled(torch.randn(16, 32))
    y.sum().backward()
    assert layer.weight.grad is not None
    assert bool(layer.fp8_meta("fwd").amax_history[0, 0] > 0)  # the compiled casts ran
    assert bool(layer.fp8_meta("bwd").amax_history[0, 0] > 0)
