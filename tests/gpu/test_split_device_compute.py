"""FP8 compute on a GPU that is not the current device (a model split over GPUs).

Triton launches on the current device, so fp8state's launches switch to the tensors' device;
this checks that training on cuda:1 while cuda:0 is current gives the same numbers as on
cuda:0 and allocates nothing on cuda:0.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import fp8state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]


def _train(device: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        fp8state.Linear(256, 512, params_dtype=torch.bfloat16, device=device),
        fp8state.LayerNormMLP(512, 1024, params_dtype=torch.bfloat16, device=device),
    )
    for m in model:
        m.fp8_min_gemm_macs = 0
    x = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    outputs = []
    for _ in range(3):
        with fp8state.fp8_autocast():
            y = model(x)
        y.float().pow(2).mean().backward()
        outputs.append(y.detach().cpu())
    outputs += [t.detach().cpu() for m in model for d in ("fwd", "bwd") for t in m.fp8_meta(d)]
    outputs += [p.grad.cpu() for p in model.parameters()]
    return outputs


def test_training_on_a_non_current_gpu_matches_and_leaves_cuda0_alone() -> None:
    torch.cuda.set_device(0)
    reference = _train("cuda:0")
    torch.cuda.synchronize(0)
    before = torch.cuda.memory_allocated(0)
    torch.cuda.reset_peak_memory_stats(0)
    got = _train("cuda:1")
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert torch.cuda.max_memory_allocated(0) == before  # not even transiently
    for a, b in zip(got, reference, strict=True):
        assert torch.equal(a, b)
