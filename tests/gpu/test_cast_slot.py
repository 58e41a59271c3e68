"""The one-launch slot cast (shift + cast + record + snapshot) against the reference path.

CUDA + Triton only. The reference is the same function on a CPU copy of every tensor, which
runs the pure functions (history shift, quantize, amax record, scale_inv copy).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from _helpers.numerics import past_the_maximum

from fp8state._runtime.slot_cast import cast_slot

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


def _fresh_launch(
    x: torch.Tensor, seed: int, fp8_dtype: torch.dtype, transpose: bool, **options: Any
) -> tuple[torch.Tensor | None, ...]:
    """``cast_launch._launch`` of ``x`` into slot 1 of fresh metadata (3 slots, 5 history
    rows), with a snapshot: its outputs, then the history."""
    from fp8state._kernels import cast_launch

    hist, scale, scale_inv = (t.cuda() for t in _buffers(5, 3, seed))
    out = cast_launch._launch(
        x, scale, scale_inv, hist, 1, 3, fp8_dtype, transpose, snapshot=True, **options
    )
    return (*out, hist)


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
    ref = cast_slot(
        x, scale, scale_inv, ref_hist, slot, torch.float8_e4m3fn, transpose=True, new_step=new_step
    )
    got_hist = hist.cuda()
    got = cast_slot(
        x.cuda(),
        scale.cuda(),
        scale_inv.cuda(),
        got_hist,
        slot,
        torch.float8_e4m3fn,
        transpose=True,
        new_step=new_step,
    )
    # Values, not bits: the CPU reference and the GPU disagree on the sign bit of NaN only.
    for a, b in ((got[0], ref[0]), (got[1], ref[1])):
        torch.testing.assert_close(a.cpu().float(), b.float(), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got[2].cpu(), ref[2])
    assert torch.equal(got_hist.cpu(), ref_hist)


@pytest.mark.parametrize("shape", [(1, 16), (33, 80), (4096, 1000), (16384, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_column_sums(shape, dtype) -> None:
    """The bias gradient from the cast's pass, in the input's dtype as ``Tensor.sum``'s."""
    x = (torch.randn(*shape, device="cuda") * 3).to(dtype)
    hist, scale, scale_inv = (t.cuda() for t in _buffers(4, 2, 1))
    for transpose in (False, True):
        *_, sums = cast_slot(
            x,
            scale,
            scale_inv,
            hist,
            0,
            torch.float8_e5m2,
            transpose=transpose,
            new_step=False,
            column_sums=True,
        )
        assert sums is not None and sums.dtype == dtype
        # float32 accumulation, one rounding to the input's dtype at the end
        exact = x.double().sum(0)
        torch.testing.assert_close(
            sums.double(), exact.to(dtype).double(), rtol=torch.finfo(dtype).eps, atol=1e-3
        )
        # Launched again (counters reset, scratch reused): the same bits.
        *_, again = cast_slot(
            x,
            scale,
            scale_inv,
            hist,
            0,
            torch.float8_e5m2,
            transpose=transpose,
            new_step=False,
            column_sums=True,
        )
        assert torch.equal(again, sums)


@pytest.mark.parametrize("shape", [(1, 16), (33, 80), (1000, 300), (4096, 1000)])
@pytest.mark.parametrize("config", [None, (16, 64, 4, 1), (32, 128, 8, 3), (64, 32, 4, 64)])
@pytest.mark.parametrize("new_step", [True, False])
@pytest.mark.parametrize("transpose", [True, False])
def test_column_sum_programs_cast_like_the_others(shape, config, new_step, transpose) -> None:
    """Programs that sum columns walk down a column tile instead of along a row block.

    Whatever the split (including more programs than row blocks, and ragged edges), the FP8
    copy, its transpose, the history and the snapshot equal those of the cast without sums.
    The last program of each column tile adds the partial rows up in the kernel.
    """
    gen = torch.Generator(device="cuda").manual_seed(shape[0])
    x = (torch.randn(*shape, device="cuda", generator=gen) * 7).to(torch.bfloat16)
    x.view(-1)[-1] = float("inf")  # not part of the amax, saturated in the copy
    results = []
    for sums in (True, False):
        out = _fresh_launch(
            x,
            2,
            torch.float8_e4m3fn,
            transpose,
            new_step=new_step,
            column_sums=sums,
            op="identity",
            aux=None,
            config=config if sums else None,
        )
        results.append(out)
    (fp8, fp8_t, snap, col, hist), (ref, ref_t, ref_snap, none, ref_hist) = results
    assert none is None and torch.equal(fp8.view(torch.uint8), ref.view(torch.uint8))
    if transpose:
        assert torch.equal(fp8_t.view(torch.uint8), ref_t.view(torch.uint8))
    else:
        assert fp8_t is None and ref_t is None
    assert torch.equal(snap, ref_snap) and torch.equal(hist, ref_hist)
    assert col.dtype == torch.bfloat16
    finite = x.double().nan_to_num(posinf=0.0)
    torch.testing.assert_close(
        col[:-1].double(), finite.sum(0)[:-1].bfloat16().double(), rtol=2**-8, atol=1e-3
    )
    assert col[-1] == float("inf")


@pytest.mark.parametrize("op", ["identity", "dgelu"])
@pytest.mark.parametrize("transpose", [True, False])
def test_long_column_walks_load_ahead_with_the_same_bits(op, transpose) -> None:
    """A column-sum program walking many row blocks loads its tiles ahead (the kernel's
    ``STAGES``); the same launch with loading ahead off gives the same bits everywhere."""
    from fp8state._kernels import cast_launch

    (m, n), config = (4096, 200), (32, 64, 4, 2)  # 64 row blocks per program
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = (torch.randn(m, n, device="cuda", generator=gen) * 5).to(torch.bfloat16)
    h = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    aux = h if op == "dgelu" else None

    def cast() -> list[torch.Tensor]:
        out = _fresh_launch(
            x,
            3,
            torch.float8_e5m2,
            transpose,
            new_step=True,
            column_sums=True,
            op=op,
            aux=aux,
            config=config,
        )
        kept = [t for t in out if t is not None]
        return [t.view(torch.uint8) if t.element_size() == 1 else t for t in kept]

    def stages() -> int | None:
        return cast_launch._plan(m, n, transpose, 3, op, True, config)[7]

    assert stages() == 3
    ahead = cast()
    saved = cast_launch.PIPELINE_FROM_BLOCKS
    try:
        cast_launch.PIPELINE_FROM_BLOCKS = 10**9
        cast_launch._plan.cache_clear()
        assert stages() is None
        plain = cast()
    finally:
        cast_launch.PIPELINE_FROM_BLOCKS = saved
        cast_launch._plan.cache_clear()
    assert len(ahead) == len(plain) == (5 if transpose else 4)
    for got, want in zip(ahead, plain, strict=True):
        assert torch.equal(got, want)


def test_repeated_launches_reuse_scratch() -> None:
    """Every new-step launch leaves its scratch zeroed, so the next one starts clean."""
    hist = torch.zeros(8, 3, device="cuda")
    scale = torch.ones(3, device="cuda")
    for step in range(1, 6):
        x = torch.full((2048, 256), float(step), device="cuda", dtype=torch.bfloat16)
        cast_slot(x, scale, scale, hist, 1, torch.float8_e4m3fn, transpose=False, new_step=True)
        cast_slot(
            x * 0.5, scale, scale, hist, 2, torch.float8_e4m3fn, transpose=False, new_step=False
        )
    expected = torch.zeros(8, 3)
    for step in range(1, 6):
        expected[5 - step, 1], expected[5 - step, 2] = step, step * 0.5
    assert torch.equal(hist.cpu(), expected)


def test_snapshot_is_a_copy() -> None:
    hist, scale, scale_inv = (t.cuda() for t in _buffers(4, 3, 0))
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    _, _, snap, _ = cast_slot(
        x, scale, scale_inv, hist, 1, torch.float8_e4m3fn, transpose=False, new_step=True
    )
    before = scale_inv[1].item()
    scale_inv.fill_(123.0)
    assert snap.item() == before


@pytest.mark.parametrize("op", ["gelu", "dgelu"])
@pytest.mark.parametrize("transpose", [False, True])
def test_fused_ops_match_reference_values(op, transpose) -> None:
    """GELU and its derivative in the kernel against torch's float32 definitions.

    The kernel computes sigmoid(2u) with exp and a fast reciprocal (about 1e-6 relative
    error), so a value right at an FP8 rounding boundary may land one step away: allowed for
    a tiny fraction of elements. Inputs reach -8, where tanh-based forms lose everything.
    """
    from fp8state.quantize import apply_op, finite_amax, quantize

    gen = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(2048, 768, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    x[0, :64] = torch.linspace(-8, 0, 64, device="cuda").to(torch.bfloat16)
    aux = (torch.randn(2048, 768, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    hist, scale, scale_inv = (t.cuda() for t in _buffers(8, 3, 4))
    before = hist.clone()
    fp8, fp8_t, _, sums = cast_slot(
        x,
        scale,
        scale_inv,
        hist,
        2,
        torch.float8_e4m3fn,
        transpose=transpose,
        new_step=True,
        column_sums=True,
        op=op,
        aux=aux if op == "dgelu" else None,
    )
    value = apply_op(x, op, aux)
    ref = quantize(value, scale[2:3], torch.float8_e4m3fn).float()
    got = fp8.float()
    off = (got != ref).float().mean().item()
    assert off < 1e-3
    assert ((got - ref).abs() <= ref.abs() * 0.125 + 2**-9).all()  # at most one E4M3 step
    # Relative accuracy where a tanh-based GELU cancels, before quantization: for a single
    # row, the column sums the kernel returns are the float32 values it cast.
    row = torch.linspace(-8, 4, 256, device="cuda").reshape(1, -1)
    h_row = torch.linspace(-8, 4, 256, device="cuda").flip(-1).reshape(1, -1)
    *_, values = cast_slot(
        row,
        scale,
        scale_inv,
        hist,
        0,
        torch.float8_e4m3fn,
        transpose=False,
        new_step=False,
        column_sums=True,
        op=op,
        aux=h_row if op == "dgelu" else None,
    )
    if op == "gelu":
        exact = torch.nn.functional.gelu(row.double(), approximate="tanh")[0]
    else:
        exact = torch.ops.aten.gelu_backward(row.double(), h_row.double(), approximate="tanh")[0]
    # atol: where the value itself is near zero (GELU's far tail, dGELU's sign change near
    # -0.75) float32 rounding leaves ~1e-8 absolute on inputs of size 1-8, far below any
    # FP8 step of such a tensor; everywhere else 1e-5 relative.
    torch.testing.assert_close(values.double(), exact, rtol=1e-5, atol=1e-6)
    if transpose:
        assert torch.equal(fp8_t.float(), got.t())
    torch.testing.assert_close(hist[0, 2], finite_amax(value), rtol=1e-5, atol=0)
    assert torch.equal(hist[1:], before[:-1])
    torch.testing.assert_close(sums, value.double().sum(0).float(), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("op", ["identity", "gelu", "dgelu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("column_sums", [False, True])
def test_transposed_copy_is_the_copy_transposed(op, dtype, column_sums) -> None:
    """The transposed FP8 copy holds the row-major copy's bytes, for every op and input dtype.

    The two layouts come from one conversion only if the compiler keeps it in the tile's own
    layout; done again in the transposed layout it went wrong for float32 inputs and the
    GELU ops (Triton 3.6). Specials included: they take the saturating paths.
    """
    gen = torch.Generator(device="cuda").manual_seed(3)
    for shape in [(8192, 2048), (4096, 512), (1000, 33), (7, 300)]:
        x = (torch.randn(*shape, device="cuda", generator=gen) * 30).to(dtype)
        x.view(-1)[:3] = torch.tensor([float("inf"), float("nan"), -1e9])
        aux = torch.randn(*shape, device="cuda", generator=gen).to(dtype) if op == "dgelu" else None
        hist, scale, scale_inv = (t.cuda() for t in _buffers(8, 3, 4))
        out, out_t, _, _ = cast_slot(
            x,
            scale,
            scale_inv,
            hist,
            1,
            torch.float8_e4m3fn,
            transpose=True,
            new_step=False,
            column_sums=column_sums,
            op=op,
            aux=aux,
        )
        assert out_t is not None
        assert torch.equal(out_t.view(torch.uint8), out.view(torch.uint8).t().contiguous()), shape


@pytest.mark.parametrize("op", ["identity", "gelu", "dgelu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("column_sums", [False, True])
def test_casts_without_a_transposed_copy_saturate_as_the_reference(
    op, dtype, fp8_dtype, column_sums
) -> None:
    """A cast that writes one layout leaves the saturation to the conversion, for every op.

    Values past the maximum and infinities become the maximum, NaN stays NaN, the rest rounds
    once: ``quantize``'s bits. The inputs keep the kernel's GELU and the reference's equal
    (GELU is the identity from about 10 up and its slope at 100 is 1, in float32 both ways),
    so the bits can be compared exactly; GELU's own values: test_fused_ops_match_reference_values.
    """
    from fp8state.quantize import apply_op, quantize

    top = torch.finfo(fp8_dtype).max
    edges = [*past_the_maximum(fp8_dtype), 10.0]
    gen = torch.Generator(device="cuda").manual_seed(17)
    x = torch.empty(61, 130, device="cuda").uniform_(10.0, 2 * top, generator=gen)
    flat = x.view(-1)
    flat[: len(edges)] = torch.tensor(edges, device="cuda")
    flat[len(edges)] = float("nan")
    if op != "gelu":  # GELU of a negative input is not the input
        flat[len(edges) + 1 :: 2] *= -1
    x = x.to(dtype)
    aux = torch.full_like(x, 100.0) if op == "dgelu" else None
    hist, scale, scale_inv = (t.cuda() for t in _buffers(8, 3, 6))
    scale.fill_(1.0)
    out, out_t, _, _ = cast_slot(
        x,
        scale,
        scale_inv,
        hist,
        1,
        fp8_dtype,
        transpose=False,
        new_step=False,
        column_sums=column_sums,
        op=op,
        aux=aux,
    )
    assert out_t is None
    ref = quantize(apply_op(x, op, aux), scale[1:2], fp8_dtype)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
