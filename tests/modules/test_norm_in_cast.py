"""A norm computed by the FP8 input cast that follows it, against the norm run apart.

``LayerNormLinear`` and ``LayerNormMLP`` hand their norm (LayerNorm or RMSNorm) to their
first GEMM, whose input cast computes it (one CUDA kernel; torch's norm then the cast
elsewhere) and whose backward runs the norm's backward. The same modules with
``return_layernorm_output=True`` must write the norm's output, so they normalize apart and
then cast: on CPU the two paths compute the same numbers, bit for bit, forward, backward and
FP8 metadata.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers.state import assert_state_equal

import fp8state
from fp8state._runtime import norm_cast
from fp8state.functional import norm as _norm
from fp8state.modules._params import input_norm


def _modules(
    kind: str, dtype: torch.dtype, fuse_gelu: bool, normalization: str = "LayerNorm"
) -> tuple[torch.nn.Module, ...]:
    torch.manual_seed(0)
    if kind == "linear":
        fused = fp8state.LayerNormLinear(32, 48, params_dtype=dtype, normalization=normalization)
    else:
        fused = fp8state.LayerNormMLP(32, 64, params_dtype=dtype, normalization=normalization)
        fused.fp8_fuse_activation = fuse_gelu
    with torch.no_grad():  # a norm that is not the identity at the start
        fused.layer_norm_weight.uniform_(0.5, 1.5)
        if fused.layer_norm_bias is not None:
            fused.layer_norm_bias.uniform_(-0.2, 0.2)
    apart = copy.deepcopy(fused)
    apart.return_layernorm_output = True
    return fused, apart


def _steps(module, inputs, grad_input: bool, frozen_norm: bool) -> list[tuple[torch.Tensor, ...]]:
    for param in (module.layer_norm_weight, module.layer_norm_bias):
        if param is not None:
            param.requires_grad_(not frozen_norm)
    results = []
    for x in inputs:
        x = x.clone().requires_grad_(grad_input)
        with fp8state.fp8_autocast(fp8_recipe=fp8state.DelayedScaling(amax_history_len=4)):
            y = module(x)
        y = y[0] if isinstance(y, tuple) else y
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        grads = [p.grad for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        results.append((y.detach(), x.grad, *grads))
    return results


@pytest.mark.parametrize("kind,fuse_gelu", [("linear", True), ("mlp", True), ("mlp", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_input,frozen_norm", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_in_the_cast_equals_the_norm_apart(
    kind, fuse_gelu, dtype, grad_input, frozen_norm, normalization
) -> None:
    fused, apart = _modules(kind, dtype, fuse_gelu, normalization)
    assert input_norm(fused) is not None and input_norm(apart) is None
    assert input_norm(fused).rms == (normalization == "RMSNorm")
    gen = torch.Generator().manual_seed(1)
    inputs = [(torch.randn(2, 5, 32, generator=gen) * (i + 1) + i).to(dtype) for i in range(3)]
    got = _steps(fused, inputs, grad_input, frozen_norm)
    want = _steps(apart, inputs, grad_input, frozen_norm)
    for got_step, want_step in zip(got, want, strict=True):
        for a, b in zip(got_step, want_step, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
    if frozen_norm:  # no gradient asked for the norm: none computed
        assert got[-1][2] is None  # the norm's weight (and bias, next, for LayerNorm)
        assert normalization == "RMSNorm" or got[-1][3] is None
    assert_state_equal(fused, apart)
    assert fused.fp8_last_gemm_backend == "emulated"


def test_the_norm_stays_apart_where_it_cannot_be_fused() -> None:
    x = torch.randn(4, 8)
    w, b = torch.ones(8), torch.zeros(8)
    assert norm_cast.fusable(x, w, b)
    assert not norm_cast.fusable(x, w.double(), b)  # the output's dtype would change
    assert not norm_cast.fusable(x.to(torch.int32), w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast runs the norm in float32
        assert not norm_cast.fusable(x, w, b)
        norm = _norm.InputNorm(w, b, 1e-5)
        out, kept = _norm.fused_or_applied(x, norm)
        assert kept is None and out.dtype == torch.float32
    rms = fp8state.LayerNormLinear(8, 8, normalization="RMSNorm", return_layernorm_output=True)
    assert input_norm(rms) is None  # the norm's output is returned: written apart


def test_norm_in_the_cast_under_torch_autocast_equals_the_norm_apart() -> None:
    fused, apart = _modules("linear", torch.float32, True)
    x = torch.randn(6, 32)
    outs = []
    for module in (fused, apart):
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8state.fp8_autocast():
            y = module(x)
        outs.append(y[0] if isinstance(y, tuple) else y)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, True)])
@pytest.mark.parametrize("rms", [False, True])
def test_norm_backward_matches_autograd(needs, rms) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 24, generator=gen) * 3 + 1
    w, b = torch.rand(24, generator=gen) + 0.5, torch.randn(24, generator=gen)
    grad = torch.randn(7, 24, generator=gen)
    if rms:
        b, needs = None, (*needs[:2], False)
    hist, scale = torch.zeros(2, 1), torch.ones(1)
    *_, stats = norm_cast.norm_cast_slot(
        x, w, b, 1e-5, scale, scale, hist, 0, torch.float8_e4m3fn, transpose=False,
        new_step=True, rms=rms,
    )  # fmt: skip
    got = norm_cast.norm_backward(grad, x, w, b, 1e-5, stats, needs, rms=rms)
    leaves = [
        t if t is None else t.clone().requires_grad_(need)
        for t, need in zip((x, w, b), needs, strict=True)
    ]
    norm = _norm.InputNorm(leaves[1], leaves[2], 1e-5, rms)
    norm(leaves[0]).backward(grad)
    for value, leaf, need in zip(got, leaves, needs, strict=True):
        assert (value is None) if not need else torch.equal(value, leaf.grad)


@pytest.mark.parametrize("rms", [False, True])
def test_norm_cast_slot_casts_the_norms_output(rms) -> None:
    x = torch.randn(9, 16) * 4
    w, b = torch.rand(16) + 0.5, (None if rms else torch.randn(16))
    hist, scale, inv = torch.zeros(3, 2), torch.tensor([2.0, 0.5]), torch.tensor([0.5, 2.0])
    got = norm_cast.norm_cast_slot(
        x, w, b, 1e-5, scale, inv, hist, 1, torch.float8_e4m3fn, transpose=True, new_step=True,
        rms=rms,
    )  # fmt: skip
    normed = _norm.InputNorm(w, b, 1e-5, rms)(x)
    assert torch.equal(got[0].float(), (normed * 0.5).to(torch.float8_e4m3fn).float())
    assert torch.equal(got[1], got[0].t().contiguous())
    assert got[2].item() == 2.0 and hist[0, 1] == normed.abs().max() and hist[0, 0] == 0
    if rms:  # its backward recomputes the norm: nothing kept
        assert got[3] == ()
    else:  # the rows' mean and reciprocal standard deviation
        torch.testing.assert_close(got[3][0].flatten(), x.mean(dim=1), rtol=1e-6, atol=1e-6)
