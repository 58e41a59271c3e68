"""The slot cast captured in a CUDA graph: every replay does what an eager launch does.

CUDA + Triton only. An eager launch shifts the history inside the kernel through a scratch
pair per stream, and finishes column sums through per-stream partial rows and tile counters;
a captured launch must not bake those shared buffers in (another launch would reuse them
between replays), so it takes a scratch pair and buffers of its own, allocated in the
graph's pool (fp8state/_kernels/cast_launch.py), and shifts in the kernel as eager launches
do. Each replay here runs on new
input values, interleaved with eager launches on the same stream, and must match an eager launch
on a copy of the history bit for bit.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fp8state._runtime.slot_cast import cast_slot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]


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
    # Warm up (compile the kernel) on a side stream, as graph capture requires.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cast(hist.clone())
    torch.cuda.current_stream().wait_stream(side)
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
