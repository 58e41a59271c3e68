"""load_state_dict never leaves a model half-loaded: values PyTorch's copy would refuse only
while loading (sparse, MKL-DNN, quantized, nested, complex into real) are refused before
anything changes, and a mapping is read once, so what was validated is what loads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import fp8state
import fp8state.checkpoint as ckpt
from fp8state.errors import StateDictError
from fp8state.schema import as_mapping

pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(fp8state.Linear(16, 16), fp8state.Linear(16, 16))
    for m in model:
        m.fp8_min_gemm_macs = 0
    with fp8state.fp8_autocast():
        model(torch.randn(4, 16) * (seed + 1)).sum().backward()
    return model


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


WEIGHTS: dict[str, Callable[[torch.Tensor], Any]] = {
    "sparse": lambda w: w.to_sparse(),
    "sparse-csr": lambda w: w.to_sparse_csr(),
    "quantized": lambda w: torch.quantize_per_tensor(w, 0.1, 0, torch.qint8),
    "complex": lambda w: w.to(torch.complex64),
}
if torch.backends.mkldnn.is_available():
    WEIGHTS["mkldnn"] = lambda w: w.to_mkldnn()


@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_an_uncopyable_weight_is_refused_before_any_module_changes(kind: str) -> None:
    model, source = _model(0), _model(1)
    before = _snapshot(model)
    sd = dict(source.state_dict())
    sd["1.weight"] = WEIGHTS[kind](sd["1.weight"])  # the right shape, the last module
    with pytest.raises(StateDictError, match=r"1\.weight"):
        ckpt.load_state_dict(model, sd)
    _assert_unchanged(model, before)  # module 0's FP8 metadata included


def test_an_uncopyable_payload_is_refused() -> None:
    model, source = _model(0), _model(1)
    before = _snapshot(model)
    sd = dict(source.state_dict())
    sd["1._extra_state"] = sd["1._extra_state"].to_sparse()
    with pytest.raises(StateDictError, match=r"1\._extra_state"):
        ckpt.load_state_dict(model, sd)
    _assert_unchanged(model, before)


class _Flipping(dict):
    """A state dict whose second read of its items answers with other values."""

    def __init__(self, first: dict, second: dict) -> None:
        super().__init__(first)
        self.answers = [first, second]

    def items(self) -> Iterator[tuple[str, Any]]:  # type: ignore[override]
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return iter(list(answer.items()))


def test_a_mapping_is_read_once_what_was_validated_loads() -> None:
    model, good, bad = _model(0), _model(1), _model(2)
    bad_sd = dict(bad.state_dict())
    bad_sd["0.weight"] = torch.full((16, 16), float("nan"))
    ckpt.load_state_dict(model, _Flipping(dict(good.state_dict()), bad_sd))
    for key, value in good.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


class _FlippingPayload(dict):
    """A schema-1 payload whose second read of its items answers with NaN scales."""

    def __init__(self, first: dict) -> None:
        super().__init__(first)
        self.reads = 0

    def items(self) -> Iterator[tuple[str, Any]]:  # type: ignore[override]
        self.reads += 1
        if self.reads == 1:
            return iter(list(dict.items(self)))
        return iter([(k, torch.full_like(v, float("nan"))) for k, v in dict.items(self)])


def test_a_payload_mapping_is_read_once() -> None:
    model, good = _model(0), _model(1)
    fields = {k: v.clone() for k, v in as_mapping(good[0].get_extra_state()).items()}
    sd = dict(good.state_dict())
    sd["0._extra_state"] = _FlippingPayload(fields)  # a schema-1 dict
    ckpt.load_state_dict(model, sd)
    assert torch.equal(model[0].fp8_meta("fwd").scale, good[0].fp8_meta("fwd").scale)
    assert torch.isfinite(model[0].fp8_meta("bwd").scale).all()
