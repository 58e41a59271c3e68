"""Batched get_extra_state (fp8state._runtime.staging): one transfer per model, never stale."""

from __future__ import annotations

import io

import pytest
import torch
from _helpers.state import assert_same, fields
from torch import nn

import fp8state
from fp8state._runtime import staging
from fp8state.schema import pack

H = 16


def _model(n: int = 4) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        *(fp8state.Linear(16, 16) for _ in range(n - 1)), fp8state.LayerNormMLP(16, 32)
    )
    _step(model)
    return model


def _step(model: nn.Module, scale: float = 1.0) -> None:
    with fp8state.fp8_autocast(fp8_recipe=fp8state.DelayedScaling(amax_history_len=8)):
        y = model(torch.randn(8, 16) * scale)
    y.sum().backward()


def test_staged_payloads_equal_the_per_module_ones() -> None:
    model = _model()
    staged = model.state_dict()
    for i, module in enumerate(model):
        assert_same(staged[f"{i}._extra_state"], pack(module.fp8_state()), ordered=True)


def test_one_staging_for_a_whole_state_dict(monkeypatch) -> None:
    model = _model(6)
    calls = []
    real = staging.stage
    monkeypatch.setattr(staging, "stage", lambda device: (calls.append(device), real(device)))
    model.state_dict()
    assert calls == [torch.device("cpu")]


def test_state_dict_after_more_training_is_current_and_the_old_one_unchanged() -> None:
    model = _model()
    first = model.state_dict()
    snapshot = first["0._extra_state"].clone()
    _step(model, scale=50.0)  # much larger amaxes: every used slot changes
    second = model.state_dict()
    assert_same(first["0._extra_state"], snapshot, ordered=True)
    assert_same(second["0._extra_state"], pack(model[0].fp8_state()), ordered=True)
    assert not torch.equal(
        fields(second["0._extra_state"])["fwd.scale"], fields(snapshot)["fwd.scale"]
    )


def test_direct_buffer_edits_are_never_hidden_by_a_staged_copy() -> None:
    model = _model()
    staging.stage(torch.device("cpu"))
    with torch.no_grad():
        model[1].fp8_meta("fwd").scale.fill_(3.0)  # bypasses the mixin's API
    assert torch.equal(fields(model[1].get_extra_state())["fwd.scale"], torch.full((3,), 3.0))


def test_loads_moves_and_recipe_changes_invalidate() -> None:
    model = _model()
    other = _model()
    _step(other, scale=9.0)
    staging.stage(torch.device("cpu"))
    model[0].load_state_dict(other[0].state_dict())
    model[1].to("cpu", torch.bfloat16)  # buffers stay float32, but may be new tensors
    model[2].fp8_recipe = fp8state.DelayedScaling(amax_history_len=4)
    for module in list(model)[:3]:
        assert_same(module.get_extra_state(), pack(module.fp8_state()), ordered=True)


def test_each_module_payload_has_its_own_small_storage() -> None:
    model = _model()
    sd = model.state_dict()
    storages = [{sd[f"{i}._extra_state"].untyped_storage().data_ptr()} for i in range(len(model))]
    for i, a in enumerate(storages):
        for b in storages[i + 1 :]:
            assert not a & b
    live = {
        t.untyped_storage().data_ptr() for m in model for d in ("fwd", "bwd") for t in m.fp8_meta(d)
    }
    assert not live & set().union(*storages)
    buf = io.BytesIO()
    torch.save(sd["0._extra_state"], buf)
    own_bytes = sd["0._extra_state"].numel() * 4
    assert buf.tell() < own_bytes + 4096  # its own bytes, not the whole model's


def _saved_size(model: nn.Module) -> int:
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.tell()


def test_a_saved_model_holds_no_bytes_of_other_live_models() -> None:
    model = _model()
    alone = _saved_size(model)
    others = [_model() for _ in range(5)]  # an EMA copy, a teacher...: staged alongside
    with_others = _saved_size(model)
    # Only the recipe integers' shared columns grow: 40 bytes per other staged module.
    other_modules = sum(len(m) for m in others)
    assert with_others - alone <= 40 * other_modules + 1024
    assert all(len(m.state_dict()) == len(model.state_dict()) for m in others)


def test_payload_is_handed_out_once() -> None:
    model = _model(2)
    a = model.state_dict()["0._extra_state"]
    b = model.state_dict()["0._extra_state"]
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert_same(a, b, ordered=True)


def test_staging_one_device_keeps_the_entries_of_another(monkeypatch) -> None:
    model = _model(3)
    staging.stage(torch.device("cpu"))
    staging.stage(torch.device("cuda", 0))  # no module there: stages nothing, drops nothing
    calls = []
    real = staging.stage
    monkeypatch.setattr(staging, "stage", lambda device: (calls.append(device), real(device)))
    model.state_dict()
    assert calls == []  # every module took its payload staged before


def test_payloads_from_one_host_block_have_storages_of_their_own() -> None:
    """The GPU path's host block: one transfer, then a tensor of its own per module."""
    model = _model(3)
    members = [(m, staging._buffers_of(m)) for m in model]
    host = torch.cat([t.reshape(-1) for _, bufs in members for t in bufs])
    padded = torch.cat([torch.full((5,), -1.0), host])  # a host view that starts mid-storage
    headers = tuple(torch.full((7,), float(i)) for i in range(len(members)))
    payloads = staging._with_headers(padded[5:], members, headers)
    offset = 0
    for (_, bufs), head, payload in zip(members, headers, payloads, strict=True):
        size = sum(t.numel() for t in bufs)
        assert payload.dtype == torch.float32 and payload.shape == (7 + size,)
        assert torch.equal(payload[:7], head)
        assert torch.equal(payload[7:], host[offset : offset + size])
        assert payload.untyped_storage().data_ptr() != padded.untyped_storage().data_ptr()
        assert payload.untyped_storage().nbytes() == (7 + size) * 4
        offset += size


def test_state_dict_under_a_default_device_context_stays_on_the_cpu() -> None:
    model = _model(3)
    with torch.device("meta"):  # e.g. while building the next model
        sd = model.state_dict()
    for key, value in sd.items():
        if key.endswith("_extra_state"):
            assert value.device.type == "cpu", key
    other = _model(3)
    other.load_state_dict(sd)
    assert_same(other[0].get_extra_state(), sd["0._extra_state"], ordered=True)


def test_deepcopied_module_counts_as_new_for_pointer_caches() -> None:
    # generation.py: a new module "may reuse a dead one's id()", so caches of buffer addresses
    # keyed by module ids must be rebuilt. deepcopy (EMA / reference models) and unpickling make
    # new modules without __init__, hence without init_fp8_meta's bump.
    import copy

    from fp8state._runtime import staging
    from fp8state._runtime.generation import buffer_generation

    model = torch.nn.Sequential(fp8state.Linear(H, H), fp8state.Linear(H, H))
    before = buffer_generation()
    clone = copy.deepcopy(model)
    assert buffer_generation() > before
    assert all(m in staging._LIVE for m in clone)  # staged with the others in state_dict()


def test_a_recipe_float32_cannot_hold_is_refused_not_rounded() -> None:
    """The packed header is float32: a margin past 2**24 would be saved as another number."""
    from fp8state.errors import SchemaError

    model = _model(2)
    model[1].fp8_recipe = fp8state.DelayedScaling(margin=2**24 + 1)
    with pytest.raises(SchemaError, match="recipe.margin"):
        model.state_dict()  # the staged path
    with pytest.raises(SchemaError, match="recipe.margin"):
        pack(model[1].fp8_state())  # the direct one
    model[1].fp8_recipe = fp8state.DelayedScaling(margin=2**24)  # the largest exact one
    assert fields(model.state_dict()["1._extra_state"])["recipe.margin"] == 2**24
