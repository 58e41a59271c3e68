"""Delayed-scaling math (fp8state.scaling): the documented edge-case table, one test per row,
and the history roll / record / window / algorithm rules. Expected values come from numpy's
IEEE float32 arithmetic, not from the code under test."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from _helpers.paths import DOCS

from fp8state import scaling
from fp8state.formats import Format

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)
PREV = 0.75  # previous scale, recognisable

FP8_MAXES = [
    pytest.param(Format.HYBRID.max("fwd"), id="E4M3-fwd448"),
    pytest.param(Format.HYBRID.max("bwd"), id="E5M2-bwd57344"),
]
MARGINS = [pytest.param(m, id=f"margin{m}") for m in (0, 1, 4)]


def _f32(x: float) -> np.float32:
    return np.float32(x)


def _expected_normal(fp8_max: float, amax: float, margin: int) -> float:
    # fp8_max / amax / 2**margin, each operation an IEEE float32 operation.
    return float(_f32(fp8_max) / _f32(amax) / _f32(2.0**margin))


AMAX_CASES = {
    # name: (amax, expected(fp8_max, margin))
    "normal": (3.3, lambda fm, m: _expected_normal(fm, 3.3, m)),
    "normal_small": (1e-3, lambda fm, m: _expected_normal(fm, 1e-3, m)),
    "normal_large": (1e30, lambda fm, m: _expected_normal(fm, 1e30, m)),
    "tiny_normal": (F32_TINY, lambda fm, m: F32_MAX),  # 448 / 1.2e-38 overflows float32
    "tiny_subnormal": (2.0**-149, lambda fm, m: F32_MAX),
    "zero": (0.0, lambda fm, m: PREV),
    "inf": (math.inf, lambda fm, m: PREV),
    "nan": (math.nan, lambda fm, m: PREV),
}


@pytest.mark.parametrize("margin", MARGINS)
@pytest.mark.parametrize("fp8_max", FP8_MAXES)
@pytest.mark.parametrize("case", list(AMAX_CASES))
def test_scale_from_amax_edge_cases(case: str, fp8_max: float, margin: int) -> None:
    amax_value, expected = AMAX_CASES[case]
    amax = torch.tensor([amax_value], dtype=torch.float32)
    prev = torch.tensor([PREV])
    scale = scaling.scale_from_amax(amax, prev, fp8_max, margin)
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    want = torch.tensor([expected(fp8_max, margin)], dtype=torch.float32)
    torch.testing.assert_close(scale, want, atol=0, rtol=0)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.isfinite(torch.reciprocal(scale)).all()


@pytest.mark.parametrize("margin", [0, 3], ids=["margin0", "margin3"])
@pytest.mark.parametrize("fp8_max", FP8_MAXES)
def test_scale_is_ieee_quotient_for_many_amaxes(fp8_max: float, margin: int, seed: int) -> None:
    # Bit-exact against one float32 division per operation, over amaxes spanning 2**-60..2**60
    # (a reciprocal-then-multiply implementation is one ulp off for about a quarter of these).
    gen = torch.Generator().manual_seed(seed)
    amax = torch.exp2(torch.rand(20_000, generator=gen) * 120 - 60)
    scale = scaling.scale_from_amax(amax, torch.ones_like(amax), fp8_max, margin)
    want = np.float32(fp8_max) / amax.numpy() / np.float32(2.0**margin)
    torch.testing.assert_close(scale, torch.from_numpy(want), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("margin", "expected"),
    [
        pytest.param(127, float(_f32(448.0) / _f32(2.0**127)), id="margin127-normal"),
        pytest.param(128, float(_f32(448.0) / _f32(2.0**64) / _f32(2.0**64)), id="margin128"),
        pytest.param(140, F32_TINY, id="margin140-underflow-clamped"),
        pytest.param(1024, F32_TINY, id="margin1024-no-overflow-error"),
        pytest.param(10**9, F32_TINY, id="margin1e9"),
    ],
)
def test_absurd_margins_stay_finite_and_positive(margin: int, expected: float) -> None:
    scale = scaling.scale_from_amax(torch.tensor([1.0]), torch.tensor([PREV]), 448.0, margin)
    torch.testing.assert_close(scale, torch.tensor([expected]), atol=0, rtol=0)


def test_mixed_slots_are_independent() -> None:
    amax = torch.tensor([2.0, 0.0, math.inf, math.nan, 2.0**-149, 448.0])
    prev = torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0, 4.0])
    scale = scaling.scale_from_amax(amax, prev, 448.0, 0)
    torch.testing.assert_close(
        scale, torch.tensor([224.0, 8.0, 7.0, 6.0, F32_MAX, 1.0]), atol=0, rtol=0
    )
    torch.testing.assert_close(prev, torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0, 4.0]), atol=0, rtol=0)


# ---------------------------------------------------------------- history


def _hist() -> torch.Tensor:
    # rows x slots, row r holds 10*(r+1) + slot: row 0 most recent.
    return torch.tensor([[10.0, 11.0], [20.0, 21.0], [30.0, 31.0], [40.0, 41.0]])


def test_shift_history_moves_rows_down_and_drops_oldest() -> None:
    h = _hist()
    out = scaling.shift_history(h)
    want = torch.tensor([[0.0, 0.0], [10.0, 11.0], [20.0, 21.0], [30.0, 31.0]])
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(h, _hist(), atol=0, rtol=0)  # pure
    assert out.data_ptr() != h.data_ptr()


def test_shift_history_single_row() -> None:
    out = scaling.shift_history(torch.tensor([[5.0, 6.0]]))
    torch.testing.assert_close(out, torch.zeros(1, 2), atol=0, rtol=0)


def test_shift_histories_in_place_equals_shift_history_of_each() -> None:
    gen = torch.Generator().manual_seed(0)
    histories = [torch.rand(rows, slots, generator=gen) for rows, slots in [(4, 3), (1, 2), (7, 6)]]
    want = [scaling.shift_history(h) for h in histories]
    storage = [h.data_ptr() for h in histories]
    scaling.shift_histories_(histories)
    for got, expected, ptr in zip(histories, want, storage, strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
        assert got.data_ptr() == ptr  # in place
    scaling.shift_histories_([])  # nothing to shift


@pytest.mark.parametrize(
    ("row0", "amax", "want"),
    [
        pytest.param(0.0, 3.0, 3.0, id="first-record"),
        pytest.param(5.0, 3.0, 5.0, id="smaller-keeps-max"),
        pytest.param(2.0, 3.0, 3.0, id="larger-takes-max"),
        pytest.param(2.0, math.inf, 2.0, id="inf-counts-as-0"),
        pytest.param(2.0, math.nan, 2.0, id="nan-counts-as-0"),
        pytest.param(0.0, -math.inf, 0.0, id="neg-inf-counts-as-0"),
        pytest.param(2.0, -1.0, 2.0, id="negative-ignored"),
    ],
)
def test_record_amax(row0: float, amax: float, want: float) -> None:
    out = scaling.record_amax(torch.tensor(row0), torch.tensor(amax))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor(want), atol=0, rtol=0)


def test_record_amax_casts_to_float32() -> None:
    out = scaling.record_amax(torch.tensor(1.0), torch.tensor(3.0, dtype=torch.bfloat16))
    assert out.dtype == torch.float32 and out.item() == 3.0


@pytest.mark.parametrize(
    ("window", "algo", "want"),
    [
        pytest.param(1, "max", [10.0, 11.0], id="max-window1"),
        pytest.param(2, "max", [20.0, 21.0], id="max-window2"),
        pytest.param(4, "max", [40.0, 41.0], id="max-window-all"),
        pytest.param(100, "max", [40.0, 41.0], id="max-window-beyond-rows"),
        pytest.param(1, "most_recent", [10.0, 11.0], id="most_recent-window1"),
        pytest.param(4, "most_recent", [10.0, 11.0], id="most_recent-ignores-window"),
    ],
)
def test_amax_from_history(window: int, algo: str, want: list[float]) -> None:
    h = _hist()
    out = scaling.amax_from_history(h, window, algo)
    torch.testing.assert_close(out, torch.tensor(want), atol=0, rtol=0)
    out.add_(1)  # a new tensor, not a view of the history
    torch.testing.assert_close(h, _hist(), atol=0, rtol=0)


def test_max_reads_only_the_window() -> None:
    # Most recent rows small, an old spike outside the window: the spike must not count.
    h = torch.tensor([[1.0], [2.0], [1000.0]])
    torch.testing.assert_close(
        scaling.amax_from_history(h, 2, "max"), torch.tensor([2.0]), atol=0, rtol=0
    )


def test_unknown_algo() -> None:
    with pytest.raises(ValueError, match="mean"):
        scaling.amax_from_history(_hist(), 1, "mean")


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_update_scale(algo: str) -> None:
    h = torch.tensor([[2.0, 0.0, 8.0], [4.0, 0.0, 1.0]])
    prev = torch.tensor([1.0, 0.5, 1.0])
    scale, scale_inv = scaling.update_scale(h, prev, window=2, algo=algo, fp8_max=448.0, margin=1)
    amax = [4.0, 0.0, 8.0] if algo == "max" else [2.0, 0.0, 8.0]
    want = torch.tensor([448.0 / amax[0] / 2, 0.5, 448.0 / 8.0 / 2])
    torch.testing.assert_close(scale, want, atol=0, rtol=0)
    torch.testing.assert_close(scale_inv, 1.0 / want, atol=0, rtol=0)
    torch.testing.assert_close(prev, torch.tensor([1.0, 0.5, 1.0]), atol=0, rtol=0)


def test_functions_run_on_device(device: torch.device) -> None:
    h = torch.tensor([[2.0, 0.0]], device=device)
    scale, scale_inv = scaling.update_scale(
        h, torch.ones(2, device=device), window=1, algo="max", fp8_max=448.0, margin=0
    )
    assert scale.device.type == scale_inv.device.type == device.type
    torch.testing.assert_close(scale.cpu(), torch.tensor([224.0, 1.0]), atol=0, rtol=0)


# ---------------------------------------------------------------- the documented table


def _docstring_table() -> list[tuple[str, str]]:
    lines = scaling.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("amax "))
    rows = []
    for line in lines[start + 2 :]:
        if line.startswith("==="):
            break
        amax, new_scale = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        rows.append((amax, new_scale.replace("``", "`")))  # rST literals -> Markdown
    return rows


def test_docstring_table_has_a_test_per_row() -> None:
    names = [amax.split()[0] for amax, _ in _docstring_table()]
    assert names == ["normal", "tiny", "0", "inf", "NaN"]
    tested = {"normal": "normal", "tiny": "tiny_normal", "0": "zero", "inf": "inf", "NaN": "nan"}
    assert {tested[n] for n in names} <= set(AMAX_CASES)


def test_concepts_doc_repeats_the_docstring_table() -> None:
    doc = (DOCS / "concepts_scaling.md").read_text()
    md_rows = re.findall(r"^\| (.+?) \| (.+?) \|$", doc, re.MULTILINE)
    for amax, new_scale in _docstring_table():
        assert (amax, new_scale) in md_rows, (amax, new_scale)


def test_sqnr_helper() -> None:
    from _helpers.numerics import sqnr

    x = torch.tensor([3.0, -4.0])
    assert sqnr(x, x) == math.inf
    assert sqnr(x, 0.9 * x) == pytest.approx(20.0)  # ||x|| / ||0.1 x|| = 10 -> 20 dB
