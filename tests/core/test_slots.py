"""Directions: "fwd" and "bwd" are the only ones; anything else is an error, never "backward"."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fp8state import Format
from fp8state.errors import ConfigError
from fp8state.schema import DIRECTIONS, default_payload, slots_per_gemm, unpack
from fp8state.slots import by_direction


def test_directions_are_forward_then_backward() -> None:
    assert DIRECTIONS == ("fwd", "bwd")
    assert [by_direction(d, "f", "b") for d in DIRECTIONS] == ["f", "b"]


_STATE = unpack(default_payload(num_gemms=1, rows=2))


@pytest.mark.parametrize(
    "call",
    [
        lambda d: by_direction(d, 1, 2),
        lambda d: Format.HYBRID.dtype(d),
        lambda d: Format.HYBRID.max(d),
        slots_per_gemm,
        _STATE.direction,
    ],
    ids=["by_direction", "Format.dtype", "Format.max", "slots_per_gemm", "FP8State.direction"],
)
@pytest.mark.parametrize("direction", ["backward", "BWD", "", "fwd "])
def test_an_unknown_direction_is_an_error(call: Callable[[str], object], direction: str) -> None:
    with pytest.raises(ConfigError, match="'fwd' or 'bwd'") as info:
        call(direction)
    assert info.value.key == "direction" and repr(direction) in info.value.found
