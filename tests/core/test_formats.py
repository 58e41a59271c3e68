"""Format numerics and TE slot numbering: the constants checkpoints and migration rely on."""

from __future__ import annotations

import pytest
import torch

import fp8state
from fp8state.formats import Format
from fp8state.slots import (
    BWD_SLOTS_PER_GEMM,
    FWD_SLOTS_PER_GEMM,
    BwdSlot,
    FwdSlot,
    bwd_slot,
    fwd_slot,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_public_names() -> None:
    assert fp8state.Format is Format


@pytest.mark.parametrize(
    ("fmt", "direction", "dtype", "fp8_max"),
    [
        pytest.param(Format.E4M3, "fwd", E4M3, 448.0, id="E4M3-fwd"),
        pytest.param(Format.E4M3, "bwd", E4M3, 448.0, id="E4M3-bwd"),
        pytest.param(Format.HYBRID, "fwd", E4M3, 448.0, id="HYBRID-fwd"),
        pytest.param(Format.HYBRID, "bwd", E5M2, 57344.0, id="HYBRID-bwd"),
    ],
)
def test_dtype_and_max_per_direction(
    fmt: Format, direction: str, dtype: torch.dtype, fp8_max: float
) -> None:
    assert fmt.dtype(direction) == dtype
    assert fmt.max(direction) == fp8_max
    assert fmt.max(direction) == float(torch.finfo(dtype).max)
    # The max is exactly representable in its FP8 dtype and in float32.
    assert torch.tensor(fp8_max).to(dtype).float().item() == fp8_max


def test_spec_fields() -> None:
    spec = Format.HYBRID.spec
    assert (spec.fwd_dtype, spec.fwd_max, spec.bwd_dtype, spec.bwd_max) == (
        E4M3,
        448.0,
        E5M2,
        57344.0,
    )


@pytest.mark.parametrize(
    ("fmt", "code"),
    [pytest.param(Format.E4M3, 0, id="E4M3"), pytest.param(Format.HYBRID, 1, id="HYBRID")],
)
def test_codes_are_the_schema_codes(fmt: Format, code: int) -> None:
    assert fmt.code == code
    assert Format.from_code(code) is fmt


@pytest.mark.parametrize("code", [-1, 2, 99], ids=["minus1", "2", "99"])
def test_unknown_code(code: int) -> None:
    with pytest.raises(KeyError):
        Format.from_code(code)


def test_every_format_has_a_code() -> None:
    assert sorted(f.code for f in Format) == list(range(len(Format)))


@pytest.mark.parametrize("gemm", [0, 1, 2])
def test_slot_numbering_is_te(gemm: int) -> None:
    # TE csrc/common.h: FP8FwdTensors GEMM1_INPUT=0, GEMM1_WEIGHT=1, GEMM1_OUTPUT=2, GEMM2_INPUT=3,
    # ...; FP8BwdTensors GRAD_OUTPUT1=0, GRAD_INPUT1=1, GRAD_OUTPUT2=2, ...
    assert FWD_SLOTS_PER_GEMM == 3 and BWD_SLOTS_PER_GEMM == 2
    assert fwd_slot(gemm, FwdSlot.INPUT) == 3 * gemm
    assert fwd_slot(gemm, FwdSlot.WEIGHT) == 3 * gemm + 1
    assert fwd_slot(gemm, FwdSlot.OUTPUT) == 3 * gemm + 2
    assert bwd_slot(gemm, BwdSlot.GRAD_OUTPUT) == 2 * gemm
    assert bwd_slot(gemm, BwdSlot.GRAD_INPUT) == 2 * gemm + 1
