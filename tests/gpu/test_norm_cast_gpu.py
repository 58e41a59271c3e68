"""A norm in the FP8 cast on CUDA: the kernels against the reference path on CPU copies.

The kernel normalizes with its own reductions, so the rows' statistics may differ from
``native_layer_norm``'s in the last bits, and where the norm's output then rounds the other
way, an element of the cast moves one FP8 step: rare, and never more. The modules' fused
paths are checked against the same modules normalizing apart.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import fp8state
from fp8state._runtime import norm_cast

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]
E4M3 = torch.float8_e4m3fn


def _inputs(shape, dtype, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=gen) * 3 + 1).to(dtype)
    w = (torch.rand(shape[1], generator=gen) + 0.5).to(dtype)
    b = (torch.randn(shape[1], generator=gen) * 0.2).to(dtype) if bias else None
    return x, w, b


def _assert_within_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """FP8 values equal but for rare elements one step apart (NaN where the reference has)."""
    got, want = got.cpu().float(), want.float()
    assert torch.equal(got.isnan(), want.isnan())
    got, want = got.nan_to_num(), want.nan_to_num()
    differ = got != want
    assert differ.float().mean() < 1e-3
    # One E4M3 step is at most 1/8 of the larger value (2**-9 near zero, the subnormals).
    step = torch.maximum(got.abs(), want.abs()) / 8 + 2**-9
    assert ((got - want).abs() <= step).all()


@pytest.mark.parametrize(
    "shape", [(1, 16), (3, 1000), (300, 64), (129, 2000), (2048, 2048), (4099, 4096), (17, 16384)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rms,bias", [(False, True), (False, False), (True, False)])
@pytest.mark.parametrize("new_step", [True, False])
def test_kernel_matches_reference(shape, dtype, rms, bias, new_step) -> None:
    x, w, b = _inputs(shape, dtype, shape[0] + shape[1], bias)
    x[0, 0] = float("inf")  # a row that normalizes to NaN: no amax from it
    gen = torch.Generator().manual_seed(7)
    hist = torch.rand(5, 3, generator=gen) * 10
    scale = torch.rand(3, generator=gen) * 4 + 0.5
    inv = 1 / scale
    kwargs = {"transpose": True, "new_step": new_step, "rms": rms}
    ref_hist = hist.clone()
    want = norm_cast.norm_cast_slot(x, w, b, 1e-5, scale, inv, ref_hist, 2, E4M3, **kwargs)
    got_hist = hist.cuda()
    got = norm_cast.norm_cast_slot(
        x.cuda(),
        w.cuda(),
        None if b is None else b.cuda(),
        1e-5,
        scale.cuda(),
        inv.cuda(),
        got_hist,
        2,
        E4M3,
        **kwargs,
    )
    _assert_within_one_step(got[0], want[0])
    assert torch.equal(
        got[1].cpu().view(torch.uint8), got[0].cpu().t().contiguous().view(torch.uint8)
    )
    assert torch.equal(got[2].cpu(), want[2])
    # The rows' statistics in float32: LayerNorm's against the reference's (in the input's
    # dtype on CPU), RMSNorm's (its reference keeps none) against the definition.
    want_stats = want[3] or (x.float().pow(2).mean(dim=1, keepdim=True).add(1e-5).rsqrt(),)
    assert len(got[3]) == (1 if rms else 2)
    finite = want_stats[0].isfinite()
    close = (
        {"rtol": 2**-7, "atol": 2**-7} if dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}
    )
    for g, w_ in zip(got[3], want_stats, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.cpu()[finite], w_.float()[finite], **close)
    # The shift and the other slots exactly; this slot's amax within the norm's rounding.
    assert torch.equal(got_hist.cpu()[1:], ref_hist[1:])
    assert torch.equal(got_hist.cpu()[0, :2], ref_hist[0, :2])
    torch.testing.assert_close(got_hist.cpu()[0, 2], ref_hist[0, 2], rtol=2**-7, atol=0)


@pytest.mark.parametrize("shape", [(1, 16), (300, 64), (2048, 2048), (4099, 4096), (5, 16384)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, True)])
@pytest.mark.parametrize("rms", [False, True])
def test_backward_kernel_matches_reference(shape, dtype, needs, rms) -> None:
    x, w, b = _inputs(shape, dtype, 11, bias=not rms)
    needs = (*needs[:2], needs[2] and not rms)
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    if rms:  # the reference recomputes the norm; the kernel takes the forward's rstd
        want_stats: tuple[torch.Tensor, ...] = ()
        stats = (x.float().pow(2).mean(dim=1, keepdim=True).add(1e-5).rsqrt(),)
    else:
        want_stats = stats = tuple(
            torch.native_layer_norm(x.float(), (shape[1],), None, None, 1e-5)[1:]
        )
    # The reference in float32 throughout; the kernel reads and writes the tensors' dtype.
    floats = [None if t is None else t.float() for t in (grad, x, w, b)]
    want = norm_cast.norm_backward(*floats, 1e-5, want_stats, needs, rms=rms)
    cuda = [None if t is None else t.cuda() for t in (grad, x, w, b)]
    got = norm_cast.norm_backward(*cuda, 1e-5, tuple(t.cuda() for t in stats), needs, rms=rms)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for g, r, need in zip(got, want, needs, strict=True):
        if not need:
            assert g is None
            continue
        assert g.dtype == dtype and g.shape == r.shape
        assert ((g.cpu().float() - r).abs().max() / r.abs().max()) < tol


@pytest.mark.parametrize("kind", ["linear", "mlp", "mlp per GEMM"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_modules_match_the_norm_apart(kind, normalization) -> None:
    torch.manual_seed(0)
    kwargs = {"params_dtype": torch.bfloat16, "device": "cuda", "normalization": normalization}
    if kind == "linear":
        fused = fp8state.LayerNormLinear(512, 1536, **kwargs)
    else:
        fused = fp8state.LayerNormMLP(512, 2048, **kwargs)
        fused.fp8_fuse_activation = kind == "mlp"
    fused.fp8_min_gemm_macs = 0
    with torch.no_grad():
        fused.layer_norm_weight.uniform_(0.5, 1.5)
        if fused.layer_norm_bias is not None:
            fused.layer_norm_bias.uniform_(-0.2, 0.2)
    apart = copy.deepcopy(fused)
    apart.return_layernorm_output = True
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16) * 2 + 0.5
    results = []
    for module in (fused, apart):
        for _ in range(3):  # scales move off their initial values
            xi = x.clone().requires_grad_(True)
            with fp8state.fp8_autocast():
                y = module(xi)
            y = y[0] if isinstance(y, tuple) else y
            y.float().pow(2).mean().backward()
            grads = [xi.grad, *(p.grad for p in module.parameters())]
            module.zero_grad(set_to_none=True)
        assert module.fp8_last_gemm_backend == "scaled_mm"
        results.append((y.detach(), grads))
    (y_f, g_f), (y_a, g_a) = results
    torch.testing.assert_close(y_f, y_a, rtol=0.1, atol=0.05)
    for a, b in zip(g_f, g_a, strict=True):
        err = (a.double() - b.double()).pow(2).sum() / b.double().pow(2).sum()
        assert err < 1e-3  # SQNR above 30 dB
    for d in ("fwd", "bwd"):
        torch.testing.assert_close(
            fused.fp8_meta(d).scale, apart.fp8_meta(d).scale, rtol=0.02, atol=0
        )
