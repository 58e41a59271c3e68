"""The one-launch slot cast (shift + cast + record + snapshot) against the reference path.

CUDA + Triton only. The reference is the same function on a CPU copy of every tensor, which
runs the pure functions (history shift, quantize, amax record, scale_inv copy).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fp8state.cast import cast_slot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]


def _buffers(rows: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hist = torch.rand(rows, n, generator=gen) * 10
    scale = torch.rand(n, generator=gen) * 4 + 0.5
    scale_inv = 1 / scale
    return hist, scale, scale_inv


@pytest.mark.parametrize("rows", [1, 2, 17, 1024, 3000])
@pytest.mark.parametrize("n,slot", [(2, 1), (3, 0), (3, 2), (6, 4), (40, 33)])
@pytest.mark.parametrize("shape", [(1, 16), (300, 64), (4096, 512)])
@pytest.mark.parametrize("new_step", [True, False])
def test_matches_reference(rows, n, slot, shape, new_step) -> None:
    hist, scale, scale_inv = _buffers(rows, n, rows * 131 + n)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(n)) * 20
    x.view(-1)[0] = float("nan")
    x = x.to(torch.bfloat16)
    ref_hist = hist.clone()
    ref = cast_slot(x, scale, scale_inv, ref_hist, slot, torch.float8_e4m3fn,
                    transpose=True, new_step=new_step)
    got_hist = hist.cuda()
    got = cast_slot(x.cuda(), scale.cuda(), scale_inv.cuda(), got_hist, slot,
                    torch.float8_e4m3fn, transpose=True, new_step=new_step)
    # Values, not bits: the CPU reference and the GPU disagree on the sign bit of NaN only.
    for a, b in ((got[0], ref[0]), (got[1], ref[1])):
        torch.testing.assert_close(a.cpu().float(), b.float(), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got[2].cpu(), ref[2])
    assert torch.equal(got_hist.cpu(), ref_hist)


def test_repeated_launches_reuse_scratch() -> None:
    """Every new-step launch leaves its scratch zeroed, so the next one starts clean."""
    hist = torch.zeros(8, 3, device="cuda")
    scale = torch.ones(3, device="cuda")
    for step in range(1, 6):
        x = torch.full((2048, 256), float(step), device="cuda", dtype=torch.bfloat16)
        cast_slot(x, scale, scale, hist, 1, torch.float8_e4m3fn, transpose=False,
                  new_step=True)
        cast_slot(x * 0.5, scale, scale, hist, 2, torch.float8_e4m3fn, transpose=False,
                  new_step=False)
    expected = torch.zeros(8, 3)
    for step in range(1, 6):
        expected[5 - step, 1], expected[5 - step, 2] = step, step * 0.5
    assert torch.equal(hist.cpu(), expected)


def test_snapshot_is_a_copy() -> None:
    hist, scale, scale_inv = (t.cuda() for t in _buffers(4, 3, 0))
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    _, _, snap = cast_slot(x, scale, scale_inv, hist, 1, torch.float8_e4m3fn,
                           transpose=False, new_step=True)
    before = scale_inv[1].item()
    scale_inv.fill_(123.0)
    assert snap.item() == before
