"""The slot cast captured in a CUDA graph: every replay does what an eager launch does.

CUDA + Triton only. A launch that opens a step gathers its amaxes in a zeroed pair, and a
column sum split over rows counts each tile's programs, in buffers kept per history that
every launch leaves zeroed (fp8state/_kernels/scratch.py); the column sums' partial rows are
per stream, and a captured launch takes its own. Each replay here runs on new input values,
interleaved with eager launches on the same stream, and must match an eager launch on a copy
of the history bit for bit; a graph captured after warm-up launches replays the kernels an
eager step launches, with no zeroing of its own.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _helpers.capture import warm_up
from torch.profiler import ProfilerActivity, profile

from fp8state._runtime.norm_cast import norm_cast_slot
from fp8state._runtime.slot_cast import cast_slot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view(torch.uint8)


@pytest.mark.parametrize("shape", [(1000, 300), (4096, 512)])
@pytest.mark.parametrize("column_sums", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("op", ["identity", "dgelu"])
def test_replays_match_eager_launches(shape, column_sums, transpose, op) -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    hist = torch.rand(5, 3, device="cuda", generator=gen) * 10
    scale = torch.rand(3, device="cuda", generator=gen) * 4 + 0.5
    scale_inv = 1 / scale
    x = torch.empty(*shape, device="cuda", dtype=torch.bfloat16)
    aux = torch.empty_like(x) if op == "dgelu" else None

    def cast(history: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return cast_slot(
            x,
            scale,
            scale_inv,
            history,
            1,
            torch.float8_e5m2,
            transpose=transpose,
            new_step=True,
            column_sums=column_sums,
            op=op,
            aux=aux,
        )

    x.normal_(generator=gen)
    if aux is not None:
        aux.normal_(generator=gen)
    warm_up(lambda: cast(hist.clone()))  # compiles the kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cast(hist)
    for trial in range(3):
        x.copy_(torch.randn(*shape, device="cuda", generator=gen) * (trial + 1) * 30)
        if aux is not None:
            aux.normal_(generator=gen)
        before = hist.clone()
        expected_hist = hist.clone()
        expected = cast(expected_hist)  # eager: in-kernel shift, shared scratch
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(hist[1:], before[:-1]), trial  # the replay shifted
        assert torch.equal(hist, expected_hist), trial
        got_fp8, got_t, got_inv, got_sums = captured
        want_fp8, want_t, want_inv, want_sums = expected
        assert torch.equal(_bits(got_fp8), _bits(want_fp8)), trial
        assert (got_t is None) == (not transpose)
        if transpose:
            assert torch.equal(_bits(got_t), _bits(want_t)), trial
        assert torch.equal(got_inv, want_inv)
        assert (got_sums is None) == (not column_sums)
        if column_sums:
            assert torch.equal(got_sums, want_sums), trial


@pytest.mark.parametrize("column_sums", [False, True])
def test_a_graph_captured_after_warm_up_replays_what_an_eager_step_launches(column_sums) -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    hist = torch.rand(5, 3, device="cuda", generator=gen) * 10
    scale = torch.rand(3, device="cuda", generator=gen) * 4 + 0.5
    scale_inv = 1 / scale
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.rand(512, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
    cast = {"transpose": True, "new_step": True}

    def step() -> tuple[torch.Tensor, ...]:
        # A step's opening records: a norm's cast, then a gradient's (4096 rows: the column
        # sums split the rows, so its tiles count their programs).
        norm = norm_cast_slot(x, weight, None, 1e-5, scale, scale_inv, hist, 0, E4M3, **cast)
        grad = cast_slot(
            x, scale, scale_inv, hist_b, 1, E5M2, **cast, column_sums=column_sums, op="identity"
        )
        return norm[0], grad[0]

    hist_b = hist.clone()
    warm_up(step)  # the buffers are made here
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    eager = _kernels(step)
    before, before_b = hist.clone(), hist_b.clone()
    replayed = _kernels(graph.replay)
    # The kernels an eager step launches (the casts, the norm's byte transpose), and nothing
    # that zeroes their buffers.
    assert sorted(replayed) == sorted(eager), (replayed, eager)
    assert not any("fill" in k.lower() for k in replayed), replayed
    assert torch.equal(hist[1:], before[:-1]) and torch.equal(hist_b[1:], before_b[:-1])


def _kernels(fn) -> list[str]:
    """The names of the GPU kernels one call of ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]
