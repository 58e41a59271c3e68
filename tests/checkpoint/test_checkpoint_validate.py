"""fp8state.checkpoint.load_state_dict: everything checked first, all problems reported at once,
the model untouched on error; FP8 metadata ends on the module's own device."""

from __future__ import annotations

import copy
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers.state import assert_same, assert_unchanged, fields, snapshot
from dist_workers import models

import fp8state.checkpoint as ckpt
from fp8state.checkpoint import StateDictError
from fp8state.errors import CheckpointError, FP8StateError, SchemaVersionError
from fp8state.schema import default_payload

# torch.compile's wrapper (used for canonical keys) imports code that warns about torch.jit.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")


def _broken_state() -> dict[str, Any]:
    state = copy.deepcopy(models.trained(seed=2, salt=2).state_dict())
    fields(state["inp._extra_state"])["fwd.scale"][1] = float("nan")  # invalid value, in place
    state["mlp._extra_state"] = default_payload(num_gemms=1, rows=16)  # a 1-GEMM payload
    state["out._extra_state"][0] = 99.0  # from the future: the packed header's version
    state["out.weight"] = torch.zeros(3, 3)  # wrong shape
    del state["norm.weight"]  # missing
    state["head.weight"] = torch.zeros(1)  # unexpected
    return state


def test_every_problem_is_reported_and_the_model_is_unchanged() -> None:
    model = models.trained()
    before = snapshot(model)
    recipe = {n: m.fp8_recipe for n, m in models.fp8_modules(model).items()}
    with pytest.raises(StateDictError) as info:
        ckpt.load_state_dict(model, _broken_state())
    err = info.value
    assert isinstance(err, CheckpointError)
    assert [p.key for p in err.problems] == [
        "inp._extra_state['fwd.scale']",
        "mlp._extra_state['fwd.scale']",
        "out.weight",
        "out._extra_state['schema_version']",
        "head.weight",
        "norm.weight",
    ]
    assert isinstance(err.problems[3], SchemaVersionError)
    for problem in err.problems:
        assert problem.key in str(err)
    assert "unchanged" in err.fix
    assert_unchanged(model, before)
    assert {n: m.fp8_recipe for n, m in models.fp8_modules(model).items()} == recipe


def test_plain_pytorch_would_have_half_loaded_the_model() -> None:
    # Why load_state_dict exists: nn.Module.load_state_dict copies module by module.
    model, source = models.trained(), models.trained(seed=2, salt=2)
    state = source.state_dict()
    state["out.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError):
        model.load_state_dict(state)
    torch.testing.assert_close(model.inp.weight, source.inp.weight)  # already overwritten
    model = models.trained()
    before = snapshot(model)
    with pytest.raises(StateDictError):
        ckpt.load_state_dict(model, state)
    assert_unchanged(model, before)


def test_strict_false_ignores_keys_but_never_bad_metadata() -> None:
    model = models.trained()
    with pytest.raises(StateDictError) as info:
        ckpt.load_state_dict(model, _broken_state(), strict=False)
    assert {p.key for p in info.value.problems} == {
        "inp._extra_state['fwd.scale']",
        "mlp._extra_state['fwd.scale']",
        "out.weight",
        "out._extra_state['schema_version']",
    }
    state = models.trained(seed=2, salt=2).state_dict()
    del state["norm.weight"]
    state["head.weight"] = torch.zeros(1)
    result = ckpt.load_state_dict(model, state, strict=False)
    assert result.missing_keys == ["norm.weight"]
    assert result.unexpected_keys == ["head.weight"]


@pytest.mark.parametrize("kind", models.KINDS)
def test_valid_state_loads_every_value(kind: str) -> None:
    source, model = models.trained(kind, seed=3, salt=3), models.trained(kind)
    ckpt.load_state_dict(model, source.state_dict())
    assert_same(models.full_state(model), models.full_state(source))
    for name, module in models.fp8_modules(model).items():
        assert module.fp8_recipe == models.fp8_modules(source)[name].fp8_recipe


@pytest.mark.parametrize("kind", models.KINDS)
def test_meta_model_materialized_with_to_empty_ends_with_checkpoint_values(
    kind: str, tmp_path: Path
) -> None:
    source = models.trained(kind, seed=4, salt=4)
    torch.save(source.state_dict(), tmp_path / "ckpt.pt")
    with torch.device("meta"):
        model = models.Net(kind)
    assert {b.device.type for b in model.buffers()} == {"meta"}
    model.to_empty(device="cpu")
    ckpt.load_state_dict(model, ckpt.load(tmp_path / "ckpt.pt"))
    assert_same(models.full_state(model), models.full_state(source))
    assert {b.device.type for b in model.buffers()} == {"cpu"}
    assert set(models.buffer_placement(model).values()) == {("Tensor", "cpu")}


def test_meta_model_without_to_empty_is_a_problem_unless_assign() -> None:
    source = models.trained(seed=4, salt=4)
    with torch.device("meta"):
        model = models.Net()
    with pytest.raises(StateDictError, match="to_empty"):
        ckpt.load_state_dict(model, source.state_dict())
    ckpt.load_state_dict(model, source.state_dict(), assign=True)
    assert_same(models.full_state(model), models.full_state(source))


def test_meta_tensors_in_the_state_dict_are_a_problem() -> None:
    with torch.device("meta"):
        meta_model = models.Net()
    state = meta_model.state_dict()
    with pytest.raises(StateDictError) as info:
        ckpt.load_state_dict(models.trained(), state)
    keys = {p.key for p in info.value.problems}
    assert "inp.weight" in keys
    assert any(k.startswith("inp._extra_state") for k in keys)


def test_canonical_keys_load_into_a_wrapped_model() -> None:
    # torch.compile's wrapper adds "_orig_mod." as DDP adds "module."; the keys of
    # get_model_state_dict (and of a consolidated DCP file) have neither.
    source, model = models.trained(seed=5, salt=5), models.trained()
    wrapped = torch.compile(model)
    assert next(iter(wrapped.state_dict())).startswith("_orig_mod.")
    ckpt.load_state_dict(wrapped, source.state_dict())
    assert_same(models.full_state(model), models.full_state(source))
    with pytest.raises(StateDictError, match="_orig_mod.norm.weight"):
        state = source.state_dict()
        del state["norm.weight"]
        ckpt.load_state_dict(wrapped, state)


def test_state_dict_metadata_follows_the_translated_keys() -> None:
    wrapped = torch.compile(models.trained())
    state = models.trained(seed=5, salt=5).state_dict()
    assert "norm" in state._metadata
    translated, problems = ckpt.validate_state_dict(wrapped, state)
    assert problems == []
    assert "_orig_mod.norm" in translated._metadata
    assert list(translated) == list(wrapped.state_dict())


def test_a_key_given_twice_is_a_problem() -> None:
    wrapped = torch.compile(models.trained())
    state = OrderedDict(models.trained(seed=5).state_dict())
    state["_orig_mod.inp.weight"] = state["inp.weight"].clone()
    _, problems = ckpt.validate_state_dict(wrapped, state)
    assert [p.key for p in problems] == ["_orig_mod.inp.weight"]


def test_extra_state_on_another_device_lands_on_the_modules_device() -> None:
    # "meta" stands in for a foreign device here: the payload is refused, never copied to it.
    model = models.trained()
    state = model.state_dict()
    state["inp._extra_state"] = state["inp._extra_state"].to("meta")
    with pytest.raises(StateDictError, match="meta"):
        ckpt.load_state_dict(model, state)


def _forbid_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("fp8state touched CUDA while handling a CPU model")

    for name in ("_lazy_init", "synchronize", "current_device", "set_device", "init"):
        monkeypatch.setattr(torch.cuda, name, forbidden)


def test_no_cuda_call_is_made_while_loading(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    source = models.trained(seed=6, salt=6)
    torch.save(source.state_dict(), tmp_path / "a.pt")
    ckpt.dcp_save(source, tmp_path / "dcp")
    _forbid_cuda(monkeypatch)
    model = models.trained()
    ckpt.load_state_dict(model, ckpt.load(tmp_path / "a.pt"))
    ckpt.dcp_load(model, tmp_path / "dcp")
    ckpt.consolidate(tmp_path / "dcp", tmp_path / "b.pt")
    ckpt.load_state_dict(model, ckpt.load(tmp_path / "b.pt"))
    assert_same(models.full_state(model), models.full_state(source))


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="where CUDA is available, torch's own DCP file writer asks for the current CUDA "
    "stream (torch.distributed.checkpoint.filesystem._OverlappingCpuLoader)",
)
def test_no_cuda_call_is_made_while_saving(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _forbid_cuda(monkeypatch)
    source = models.trained(seed=6, salt=6)
    torch.save(source.state_dict(), tmp_path / "a.pt")
    ckpt.dcp_save(source, tmp_path / "dcp")
    model = models.trained()
    ckpt.dcp_load(model, tmp_path / "dcp")
    assert_same(models.full_state(model), models.full_state(source))


def test_not_a_mapping_is_a_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="mapping"):
        ckpt.load_state_dict(models.trained(), [torch.ones(1)])  # type: ignore[arg-type]


def test_the_error_survives_pickling_with_its_problems() -> None:
    with pytest.raises(StateDictError) as info:
        ckpt.load_state_dict(models.trained(), _broken_state())
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == str(info.value)
    assert [p.key for p in again.problems] == [p.key for p in info.value.problems]
    assert all(isinstance(p, FP8StateError) for p in again.problems)


def test_long_problem_lists_are_shortened_in_the_message() -> None:
    model = torch.nn.Sequential(*[models.OneGemm(2, 2) for _ in range(30)])
    state = {"0._extra_state": model[0].get_extra_state()}  # FP8 metadata of one module only
    with pytest.raises(StateDictError) as info:
        ckpt.load_state_dict(model, state)
    assert len(info.value.problems) == 89  # weight and bias of each, 29 _extra_states
    assert "and 69 more" in str(info.value)
    assert "(89 keys)" in info.value.key


def test_a_plain_state_dict_is_named_as_such_and_weights_are_still_listed() -> None:
    model = models.trained()
    before = snapshot(model)
    plain = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    del plain["norm.weight"]  # a real missing weight ...
    plain["decoder.weight"] = torch.zeros(2)  # ... and a real unexpected one
    with pytest.raises(StateDictError) as info:
        ckpt.load_state_dict(model, plain)
    problems = info.value.problems
    extra = [p for p in problems if "_extra_state" in p.key]
    assert len(extra) == 1  # one problem for all FP8 modules, not one per module
    assert "without FP8 metadata" in extra[0].found
    assert "fp8state.checkpoint.load_plain_state_dict" in extra[0].fix
    assert sorted(p.key for p in problems if p not in extra) == ["decoder.weight", "norm.weight"]
    for problem in extra:
        assert "strict=False" not in str(problem)
    _, found = ckpt.validate_state_dict(model, plain)
    assert [str(p) for p in found] == [str(p) for p in problems]
    assert_unchanged(model, before)


def test_some_missing_metadata_is_listed_per_module_without_strict_false() -> None:
    model = models.trained()
    state = model.state_dict()
    del state["mlp._extra_state"]
    with pytest.raises(StateDictError) as info:
        ckpt.load_state_dict(model, state)
    (problem,) = info.value.problems
    assert problem.key == "mlp._extra_state" and "strict=False" not in str(problem)
    assert "load_plain_state_dict" in problem.fix


def test_the_summary_is_on_a_line_of_its_own() -> None:
    model = models.trained()
    state = model.state_dict()
    del state["norm.weight"]
    with pytest.raises(StateDictError) as info:
        ckpt.load_state_dict(model, state)
    lines = str(info.value).splitlines()
    assert lines[0] == "norm.weight: found 1 problem(s):"
    assert lines[1].startswith("  - norm.weight: found no such key")
    assert lines[2].startswith("Expected a state dict that fits ")
    assert ".; expected" not in str(info.value)
