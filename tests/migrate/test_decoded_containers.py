"""What a pickled checkpoint decodes to is plain data: no Parameter comes back with pickled
attributes (hooks among them), and no state dict with attributes that shadow a mapping's
methods; either is refused with nothing set."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from _helpers.cli import run_cli

from fp8state.errors import LegacyFormatError
from fp8state.migrate import load_te_checkpoint


class _ParameterWithState:
    """Pickles as torch pickles a Parameter that carries attributes."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def __reduce__(self) -> tuple:
        args = (torch.ones(2), True, collections.OrderedDict(), self.state)
        return (torch._utils._rebuild_parameter_with_state, args)


@pytest.mark.parametrize(
    "state",
    [{"_backward_hooks": collections.OrderedDict([(0, torch.Size)])}, {"note": 1}],
    ids=["hooks", "attribute"],
)
def test_a_parameter_with_pickled_attributes_is_refused(tmp_path: Path, state: dict) -> None:
    torch.save({"weight": _ParameterWithState(state)}, tmp_path / "p.pt")
    with pytest.raises(LegacyFormatError, match="Parameter with pickled attributes"):
        load_te_checkpoint(tmp_path / "p.pt")


def test_a_plain_parameter_still_loads(tmp_path: Path) -> None:
    torch.save({"weight": torch.nn.Parameter(torch.ones(2))}, tmp_path / "p.pt")
    weight = load_te_checkpoint(tmp_path / "p.pt")["weight"]
    assert torch.equal(weight, torch.ones(2)) and not weight._backward_hooks


@pytest.mark.parametrize("name", ["keys", "get", "values", "__class__"])
def test_a_state_dict_whose_attributes_shadow_its_methods_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    state = collections.OrderedDict(weight=torch.ones(2))
    state.__dict__[name] = "shadow"  # pickled as the dict's instance state
    torch.save(state, tmp_path / "s.pt")
    with pytest.raises(LegacyFormatError, match="setting the state of a OrderedDict"):
        load_te_checkpoint(tmp_path / "s.pt")
    code, _, err = run_cli(capsys, "migrate", str(tmp_path / "s.pt"), str(tmp_path / "o.pt"))
    assert code == 1 and err.count("\n") == 1 and not (tmp_path / "o.pt").exists()


def test_a_state_dicts_metadata_attribute_still_loads(tmp_path: Path) -> None:
    state = torch.nn.Linear(2, 2).state_dict()
    assert hasattr(state, "_metadata")
    torch.save(state, tmp_path / "s.pt")
    loaded = load_te_checkpoint(tmp_path / "s.pt")
    assert list(loaded.keys()) == ["weight", "bias"]
