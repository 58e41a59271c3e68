"""Malformed values inside TE extra states end as one FP8StateError naming the key, never as
an exception from deep inside torch: nested and other non-dense tensors where dense ones
belong, and recipe fields of the wrong type."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import te_gen.payloads as te_payloads
import torch
from te_gen import Spec, extra_state

from fp8state.errors import LegacyFormatError
from fp8state.migrate import decode_te_extra_state
from fp8state.schema import as_mapping

KINDS: dict[str, Callable[[torch.Tensor], Any]] = {
    "nested": lambda t: torch.nested.nested_tensor([t.float().flatten()]),
    "sparse": lambda t: t.to_sparse(),
    "quantized": lambda t: torch.quantize_per_tensor(t.float(), 0.1, 0, torch.qint8),
    "meta": lambda t: t.to("meta"),
    "list": lambda t: t.tolist(),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("key", ["scale_fwd", "amax_history_bwd"])
def test_a_non_dense_tensor_is_a_legacy_format_error(key: str, kind: str) -> None:
    value, _ = extra_state("E03", Spec())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested and quantized tensors warn they are new/old
        value[key] = KINDS[kind](value[key])
    with pytest.raises(LegacyFormatError, match=key):
        decode_te_extra_state(value)


def _with_recipe_field(monkeypatch: pytest.MonkeyPatch, name: str, value: Any) -> None:
    make = te_payloads.recipes.delayed_scaling

    def patched(era: str, **kwargs: Any) -> Any:
        recipe = make(era, **kwargs)
        recipe.__dict__[name] = value
        return recipe

    monkeypatch.setattr(te_payloads.recipes, "delayed_scaling", patched)


@pytest.mark.parametrize(
    ("name", "value"),
    [("amax_compute_algo", torch.tensor([1, 2])), ("fp8_format", [1]), ("margin", [0])],
    ids=["algo-tensor", "format-list", "margin-list"],
)
def test_recipe_fields_of_the_wrong_type_are_refused(
    monkeypatch: pytest.MonkeyPatch, name: str, value: Any
) -> None:
    _with_recipe_field(monkeypatch, name, value)
    with pytest.raises(LegacyFormatError, match=name):
        decode_te_extra_state(extra_state("E08", Spec())[0])


@pytest.mark.parametrize("value", [torch.tensor([4, 5]), 4.5, "16"], ids=["tensor", "float", "str"])
def test_a_strange_pickled_history_length_is_only_noted(
    monkeypatch: pytest.MonkeyPatch, value: Any
) -> None:
    # The history's rows are the window whatever the pickled recipe says (docs/migration.md).
    _with_recipe_field(monkeypatch, "amax_history_len", value)
    fields = as_mapping(decode_te_extra_state(extra_state("E08", Spec(rows=16))[0]))
    assert int(fields["recipe.amax_history_len"]) == 16 == fields["fwd.amax_history"].shape[0]


@pytest.mark.parametrize("value", [[448], {"a": 1}, torch.tensor([448.0]), "448"], ids=str)
@pytest.mark.parametrize("era", ["E03", "E05"])
def test_stored_fp8_maxima_of_the_wrong_type_are_refused(era: str, value: Any) -> None:
    extra_state_value, _ = extra_state(era, Spec(extra={"fp8_max_fwd": value}))
    with pytest.raises(LegacyFormatError, match="fp8 maxima"):
        decode_te_extra_state(extra_state_value)
