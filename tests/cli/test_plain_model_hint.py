"""An FP8 checkpoint loaded into a plain PyTorch model: the error points at the interop guide.

``strict=False`` would load it and also hide every genuinely missing or misspelled weight
(docs/faq.md), so it is not the fix the error gives; the export of docs/interop.md is.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _helpers.paths import DOCS

import fp8state
from fp8state.checkpoint import StateDictError, load_state_dict, to_plain_state_dict


def _plain() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    plain = _plain()
    return plain, fp8state.convert_model(copy.deepcopy(plain))


def test_the_error_names_each_fp8_key_and_the_interop_export() -> None:
    plain, fp8_model = _models()
    fresh = _plain()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(StateDictError) as info:
        load_state_dict(fresh, fp8_model.state_dict())
    problems = {p.key: p for p in info.value.problems}
    assert set(problems) == {"0._extra_state", "2._extra_state"}
    for problem in problems.values():
        assert "FP8 metadata" in problem.found and "strict=False" not in str(problem)
        assert "fp8state.checkpoint.to_plain_state_dict" in problem.fix
        assert "docs/interop.md" in problem.fix
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())  # unchanged
    # What the fix says works: the export loads strictly into the plain model.
    fresh.load_state_dict(to_plain_state_dict(fp8_model), strict=True)
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in fresh.state_dict().items())


def test_the_guide_it_points_at_documents_that_export() -> None:
    guide = (DOCS / "interop.md").read_text()
    assert "to_plain_state_dict(" in guide and "save_safetensors(" in guide


def test_other_unexpected_keys_keep_their_own_message() -> None:
    plain, _ = _models()
    state = dict(plain.state_dict(), **{"head.weight": torch.zeros(1)})
    with pytest.raises(StateDictError) as info:
        load_state_dict(plain, state)
    (problem,) = info.value.problems
    assert problem.key == "head.weight" and problem.found == "a key the model does not have"
