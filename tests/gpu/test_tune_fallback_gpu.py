"""``tune_fallback`` on CUDA: real FP8 GEMMs and fallbacks timed, the model put back bit for bit.

CUDA only. The fallback thresholds matter for ``torch._scaled_mm`` (the emulation never falls
back by default): a step whose GEMMs straddle the default threshold runs every candidate, the
metadata the Triton kernels wrote and the CUDA generator come back as they were, and the
chosen threshold decides which GEMMs then run in FP8.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_tuning_on_cuda_puts_the_model_back_and_decides_the_gemms() -> None:
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    model = nn.Sequential(
        fp8state.LayerNormMLP(256, 1024, **kw), nn.Dropout(0.1), fp8state.Linear(256, 128, **kw)
    )
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step() -> None:
        with fp8state.fp8_autocast():
            y = model(x)
        y.float().square().mean().backward()

    step()
    meta = {
        n: [t.clone() for d in ("fwd", "bwd") for t in m.fp8_meta(d)]
        for n, m in [("0", model[0]), ("2", model[2])]
    }
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.cuda.get_rng_state()
    tuning = fp8state.tune_fallback(model, step, steps=2, repeats=2, warmup=1)
    assert tuning.gemm_macs == (512 * 256 * 128, 512 * 256 * 1024)
    for name, module in (("0", model[0]), ("2", model[2])):
        live = [t for d in ("fwd", "bwd") for t in module.fp8_meta(d)]
        assert all(torch.equal(a, b) for a, b in zip(live, meta[name], strict=True))
        assert module.fp8_min_gemm_macs == tuning.chosen
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    step()
    fp8 = set(tuning.fp8_gemm_macs(tuning.chosen))
    expected = ["scaled_mm" if size in fp8 else "high_precision" for size in tuning.gemm_macs]
    assert [model[2].fp8_last_gemm_backend, model[0].fp8_last_gemm_backend] == expected
