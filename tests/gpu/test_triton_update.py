"""The fused scale-update kernel against fp8state.scaling.update_scale, bit for bit."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fp8state.scaling import update_scale

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 5, 130, 400])
@pytest.mark.parametrize(("rows", "n", "window"), [(1024, 3, 1024), (16, 6, 4), (7, 3000, 7)])
def test_update_kernel_matches_reference(algo, margin, rows, n, window) -> None:
    from fp8state._kernels.triton_update import update_scales_

    gen = torch.Generator(device="cuda").manual_seed(rows * n + margin)
    history = torch.rand(rows, n, device="cuda", generator=gen) * 100
    history[:, 0] = 0  # never recorded: keeps the previous scale
    history[0, 1 % n] = 1e-39  # tiny: the quotient overflows and is clamped
    history[1:, 2 % n] = 0  # only row 0 recorded
    prev = torch.rand(n, device="cuda", generator=gen) + 0.5
    ref_scale, ref_inv = update_scale(
        history, prev, window=window, algo=algo, fp8_max=448.0, margin=margin
    )
    scale, scale_inv = prev.clone(), torch.empty_like(prev)
    update_scales_(
        history, scale, scale_inv, window=window, algo=algo, fp8_max=448.0, margin=margin
    )
    assert torch.equal(scale, ref_scale)
    assert torch.equal(scale_inv, ref_inv)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_batched_update_matches_reference_per_module(algo) -> None:
    from fp8state._kernels.triton_update import PointerTable, batched_update_scales_

    gen = torch.Generator(device="cuda").manual_seed(7)
    shapes = [(1024, 3), (1024, 6), (16, 3), (8, 6)] * 50
    hists = [torch.rand(r, n, device="cuda", generator=gen) * 10 for r, n in shapes]
    for h in hists[::3]:
        h[:, 0] = 0
    scales = [torch.rand(n, device="cuda", generator=gen) + 0.5 for _, n in shapes]
    invs = [torch.empty_like(s) for s in scales]
    expected = [
        update_scale(h, s, window=12, algo=algo, fp8_max=57344.0, margin=2)
        for h, s in zip(hists, scales, strict=True)
    ]
    table = PointerTable(hists, scales, invs, window=12)
    batched_update_scales_(table, algo=algo, fp8_max=57344.0, margin=2)
    for (ref_scale, ref_inv), scale, inv in zip(expected, scales, invs, strict=True):
        assert torch.equal(scale, ref_scale) and torch.equal(inv, ref_inv)
