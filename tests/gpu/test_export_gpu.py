"""On a GPU with FP8 GEMMs: the exported FP8 weight, weight_scale and input_scale fed to
torch._scaled_mm reproduce fp8state's FP8 forward of the same input bit for bit, wherever
1 / input_scale (how a serving engine casts its input) is the scale training cast with."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import fp8state
from fp8state import quantize
from fp8state.export import export_fp8

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 GEMMs (Ada or Hopper)",
)
safetensors_torch = pytest.importorskip("safetensors.torch")

SEEDS = range(8)
TOKENS = 2048


def _one(seed: int, folder: Path) -> dict:
    torch.manual_seed(seed)
    recipe = fp8state.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    model = torch.nn.Sequential(fp8state.Linear(2048, 2048)).cuda().to(torch.bfloat16)
    model[0].fp8_recipe = recipe
    model[0].fp8_min_gemm_macs = 0  # FP8 at this size too
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = (TOKENS, 2048)
    for _ in range(3):
        x = torch.randn(batch, device="cuda", dtype=torch.bfloat16)
        with fp8state.fp8_autocast(fp8_recipe=recipe):
            model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    # One forward with the final weights: their amax is the newest row of the weight's history,
    # so the scale the next forward casts the weight with is the one export takes from the
    # weight itself (most_recent); the input's is the one export takes from the history.
    with torch.no_grad(), fp8state.fp8_autocast(fp8_recipe=recipe):
        model(torch.randn(batch, device="cuda", dtype=torch.bfloat16))
    export_fp8(model, folder)
    trained_scale = model[0].fp8_meta("fwd").scale[0:1].clone()
    x = torch.randn(batch, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), fp8state.fp8_autocast(fp8_recipe=recipe):
        reference = model(x)
    tensors = safetensors_torch.load_file(folder / "model.safetensors", device="cuda")
    input_scale = tensors["0.input_scale"]
    # A serving engine casts the input with 1 / input_scale.
    x_fp8 = quantize.quantize(x, torch.reciprocal(input_scale), torch.float8_e4m3fn)
    served = torch._scaled_mm(
        x_fp8,
        tensors["0.weight"].t(),
        scale_a=input_scale,
        scale_b=tensors["0.weight_scale"],
        bias=tensors["0.bias"],
        out_dtype=torch.bfloat16,
        use_fast_accum=True,  # as fp8state's (and TE's) forward GEMMs
    )
    return {
        "seed": seed,
        "input_scale_round_trips": bool(torch.equal(torch.reciprocal(input_scale), trained_scale)),
        "bit_exact": bool(torch.equal(served, reference)),
        "max_abs_diff": float((served.float() - reference.float()).abs().max()),
        "max_abs_output": float(reference.float().abs().max()),
    }


def test_exported_scales_reproduce_the_fp8_forward(tmp_path: Path) -> None:
    runs = [_one(seed, tmp_path / f"out{seed}") for seed in SEEDS]
    result = {
        "shape": f"{TOKENS}x2048x2048",
        "runs": runs,
        "bit_exact_where_round_trip": all(
            r["bit_exact"] for r in runs if r["input_scale_round_trips"]
        ),
        "command": "python -m pytest -q tests/gpu/test_export_gpu.py",
    }
    if os.environ.get("FP8STATE_RESULTS"):
        Path(os.environ["FP8STATE_RESULTS"]).write_text(json.dumps(result, indent=2))
    assert any(r["input_scale_round_trips"] for r in runs)
    assert result["bit_exact_where_round_trip"], runs
    for run in runs:  # otherwise one ulp of the input scale: a few inputs on a rounding edge
        assert run["max_abs_diff"] <= run["max_abs_output"] * 2**-4, run
