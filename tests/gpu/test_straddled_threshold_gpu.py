"""Two ranks whose batches put a GEMM on both sides of its FP8 threshold, on CUDA.

The same worker and checks as the gloo test in tests/runtime/test_distributed_amax.py, with
real FP8 GEMMs: NCCL with a GPU per rank on two GPUs (where ranks reducing different modules
would hang instead of fail), gloo with both ranks on the one GPU otherwise.
"""

from __future__ import annotations

import pytest
import torch
from _helpers.straddle import assert_ranks_reduced_alike
from dist_workers.amax_worker import run
from dist_workers.launch import free_port, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_ranks_on_cuda_reduce_the_same_modules(tmp_path) -> None:
    steps = 3
    args = (2, free_port(), str(tmp_path), "straddle", steps, "cuda")
    run_ranks(run, 2, args, timeout=300)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert_ranks_reduced_alike(results, steps)
