"""Malformed TE extra states: each raises LegacyFormatError naming the key, what was found, what
was expected and the fix (one test id per corruption)."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from te_gen import recipes
from te_gen.tepickle import as_uint8, te_dumps, te_name

from fp8state.errors import LegacyFormatError
from fp8state.migrate import decode_te_extra_state


def e07(**change: Any) -> dict[str, Any]:
    """A valid (already unpickled) TE v1.6-v1.13 dict for one GEMM, with changes applied."""
    state: dict[str, Any] = {
        "scale_fwd": torch.full((3,), 2.0),
        "scale_inv_fwd": torch.full((3,), 0.5),
        "amax_history_fwd": torch.rand(4, 3),
        "scale_bwd": torch.full((2,), 2.0),
        "scale_inv_bwd": torch.full((2,), 0.5),
        "amax_history_bwd": torch.rand(4, 2),
        "extra_fp8_variables": {"num_gemms": 1, "fp8_max_fwd": 448, "fp8_max_bwd": 57344},
    }
    for key, value in change.items():
        if value is None:
            del state[key]
        else:
            state[key] = value
    return state


def poke(key: str, index: tuple[int, ...], value: float) -> dict[str, Any]:
    state = e07()
    state[key] = state[key].clone()
    state[key][index] = value
    return state


def e08(recipe: Any = None, **change: Any) -> torch.Tensor:
    """A TE v2.x uint8 pickle with a recipe object."""
    state: dict[str, Any] = {"recipe": recipe or recipes.delayed_scaling("E09", length=4)}
    state.update({k: v for k, v in e07().items() if not k.startswith("scale_inv")})
    state.update(change)
    return as_uint8(te_dumps(state))


def old_dict(**change: Any) -> dict[str, Any]:
    """A TE v0.3-v0.4 dict (2 fwd / 1 bwd per GEMM) with the recompute buffer key."""
    state = {
        "scale_fwd": torch.ones(2),
        "amax_history_fwd": torch.zeros(4, 2),
        "scale_bwd": torch.ones(1),
        "amax_history_bwd": torch.zeros(4, 1),
        "global_fp8_buffer": {},
        "global_fp8_recompute_buffer": [],
        "extra_fp8_variables": {"num_gemms": 1},
    }
    state.update(change)
    return state


@te_name(recipes.RECIPE, "Format")
class UnknownFormat:
    """Pickles as ``Format(_FormatHelper(1, 2))``: a member no TE release has."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (UnknownFormat, (recipes.FormatHelper(1, 2),))


def _pickled(obj: Any) -> torch.Tensor:
    return as_uint8(pickle.dumps(obj))


# id -> (value factory, num_gemms passed, substring of the error key, substring of `found`)
CASES: dict[str, tuple[Callable[[], Any], int | None, str, str]] = {
    "list-of-9": (lambda: [torch.ones(2)] * 9, None, "", "list of 9"),
    "list-item-not-tensor": (lambda: [1.0] + [torch.ones(2)] * 9, None, "scale_fwd", "float"),
    "missing-key": (lambda: e07(amax_history_bwd=None), None, "amax_history_bwd", "keys"),
    "float64-scale": (
        lambda: e07(scale_fwd=torch.ones(3, dtype=torch.float64)),
        None,
        "scale_fwd",
        "float64",
    ),
    "1d-history": (
        lambda: e07(amax_history_fwd=torch.zeros(3)),
        None,
        "amax_history_fwd",
        "shape (3,)",
    ),
    "history-columns": (
        lambda: e07(amax_history_fwd=torch.zeros(4, 2)),
        None,
        "amax_history_fwd",
        "(4, 2)",
    ),
    "history-rows-differ": (
        lambda: e07(amax_history_bwd=torch.zeros(5, 2)),
        None,
        "amax_history_bwd",
        "5 rows",
    ),
    "zero-rows": (
        lambda: e07(amax_history_fwd=torch.zeros(0, 3), amax_history_bwd=torch.zeros(0, 2)),
        None,
        "amax_history_fwd",
        "0",
    ),
    "slot-ratio": (
        lambda: e07(
            scale_bwd=torch.ones(3), scale_inv_bwd=torch.ones(3), amax_history_bwd=torch.zeros(4, 3)
        ),
        None,
        "scale_bwd",
        "3 forward and 3 backward",
    ),
    "empty-scale": (
        lambda: e07(
            scale_fwd=torch.ones(0), scale_inv_fwd=torch.ones(0), amax_history_fwd=torch.zeros(4, 0)
        ),
        None,
        "amax_history_fwd",
        "(4, 0)",
    ),
    "nan-scale": (lambda: poke("scale_fwd", (1,), float("nan")), None, "scale_fwd", "nan"),
    "zero-scale": (lambda: poke("scale_bwd", (0,), 0.0), None, "scale_bwd", "0.0"),
    "negative-scale": (lambda: poke("scale_fwd", (0,), -2.0), None, "scale_fwd", "-2.0"),
    "inf-scale": (lambda: poke("scale_fwd", (2,), float("inf")), None, "scale_fwd", "inf"),
    "zero-scale-inv": (lambda: poke("scale_inv_bwd", (1,), 0.0), None, "scale_inv_bwd", "0.0"),
    "inf-amax": (
        lambda: poke("amax_history_fwd", (2, 1), float("inf")),
        None,
        "amax_history_fwd",
        "inf",
    ),
    "nan-amax": (
        lambda: poke("amax_history_bwd", (0, 0), float("nan")),
        None,
        "amax_history_bwd",
        "nan",
    ),
    "negative-amax": (
        lambda: poke("amax_history_fwd", (3, 0), -1.0),
        None,
        "amax_history_fwd",
        "-1.0",
    ),
    "one-scale-inv": (lambda: e07(scale_inv_bwd=None), None, "scale_inv_bwd", "only one"),
    "scale-inv-shape": (lambda: e07(scale_inv_fwd=torch.ones(2)), None, "scale_inv_fwd", "(2,)"),
    "te-num-gemms": (
        lambda: e07(extra_fp8_variables={"num_gemms": 2}),
        None,
        "num_gemms",
        "num_gemms 2",
    ),
    "arg-num-gemms": (lambda: e07(), 2, "", "1 GEMM"),
    "efv-not-dict": (lambda: e07(extra_fp8_variables=[1]), None, "extra_fp8_variables", "list"),
    "e5m2-maxima": (
        lambda: e07(extra_fp8_variables={"fp8_max_fwd": 57344, "fp8_max_bwd": 57344}),
        None,
        "fp8_max_bwd",
        "57344",
    ),
    "old-dict-new-layout": (
        lambda: old_dict(
            scale_fwd=torch.ones(3),
            scale_bwd=torch.ones(2),
            amax_history_fwd=torch.zeros(4, 3),
            amax_history_bwd=torch.zeros(4, 2),
        ),
        None,
        "scale_fwd",
        "3 forward / 2 backward",
    ),
    "pickle-old-layout": (
        lambda: _pickled(
            {k: v for k, v in old_dict().items() if k != "global_fp8_recompute_buffer"}
        ),
        None,
        "scale_fwd",
        "2 forward / 1 backward",
    ),
    "non-string-key": (lambda: {1: torch.ones(1)}, None, "", "int"),
    "none-key": (lambda: {**e07(), None: torch.ones(1)}, None, "", "NoneType"),
    "unknown-dict": (lambda: {"fwd.scale": torch.ones(3)}, None, "scale_fwd", "fwd.scale"),
    "ops-fp8-state": (
        lambda: _pickled({"forward": {"scale_fwd": torch.ones(1)}}),
        None,
        "",
        "ops-based",
    ),
    "meta-tensor": (lambda: e07(scale_fwd=torch.ones(3, device="meta")), None, "scale_fwd", "meta"),
    "meta-container": (lambda: torch.ones(4, dtype=torch.uint8, device="meta"), None, "", "meta"),
    "str-container": (lambda: "scale_fwd", None, "", "str"),
    "bytes-container": (lambda: pickle.dumps(e07()), None, "", "bytes"),
    "2d-uint8": (lambda: torch.zeros(2, 2, dtype=torch.uint8), None, "", "(2, 2)"),
    "float-tensor": (lambda: torch.ones(3), None, "", "float32"),
    "pickled-list": (lambda: _pickled([1, 2]), None, "", "list"),
    "recipe-e5m2": (
        lambda: e08(recipes.delayed_scaling("E09", fmt="E5M2", length=4)),
        None,
        "fp8_format",
        "E5M2",
    ),
    "recipe-margin": (
        lambda: e08(recipes.delayed_scaling("E09", margin=-1, length=4)),
        None,
        "margin",
        "-1",
    ),
    "recipe-algo": (
        lambda: e08(recipes.delayed_scaling("E09", algo="median", length=4)),
        None,
        "amax_compute_algo",
        "median",
    ),
    "recipe-not-object": (lambda: e08("DelayedScaling"), None, "recipe", "str"),
    "stateless-with-tensors": (
        lambda: e08(recipes.stateless("MXFP8BlockScaling")),
        None,
        "recipe",
        "MXFP8BlockScaling",
    ),
    "delayed-without-tensors": (
        lambda: as_uint8(
            te_dumps({"recipe": recipes.delayed_scaling("E09"), "extra_fp8_variables": {}})
        ),
        None,
        "scale_fwd",
        "no such key",
    ),
    "unknown-format-value": (
        lambda: e08(
            recipes.DelayedScaling(
                margin=0, fp8_format=UnknownFormat(), amax_history_len=4, amax_compute_algo="max"
            )
        ),
        None,
        "fp8_format",
        "(1, 2)",
    ),
    "bytesio-not-archive": (
        lambda: io.BytesIO(b"not a torch.save archive"),
        None,
        "",
        "cannot be decoded",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_extra_state(case: str) -> None:
    make, num_gemms, key_part, found_part = CASES[case]
    with pytest.raises(LegacyFormatError) as info:
        decode_te_extra_state(make(), num_gemms=num_gemms)
    err = info.value
    assert key_part in err.key, err
    assert found_part in err.found, err
    assert err.expected and err.fix
    assert "\n" not in str(err)


def test_error_names_state_dict_key_when_loading() -> None:
    from fp8state.migrate import convert_te_state_dict

    sd = {
        "blocks.3.fc.weight": torch.ones(2, 2),
        "blocks.3.fc._extra_state": poke("scale_fwd", (0,), float("nan")),
    }
    with pytest.raises(LegacyFormatError) as info:
        convert_te_state_dict(sd)
    assert info.value.key == "blocks.3.fc._extra_state['scale_fwd']"
    out, report = convert_te_state_dict(sd, strict=False)
    assert list(out) == ["blocks.3.fc.weight"]
    assert report.failed()[0].error.startswith("blocks.3.fc._extra_state['scale_fwd']: found")
