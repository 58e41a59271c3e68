"""Batched get_extra_state (fp8state.staging): one transfer for a whole model, never stale."""

from __future__ import annotations

import io
import itertools
import weakref

import torch
from torch import nn

import fp8state
from fp8state import staging
from fp8state.schema import pack


def _model(n: int = 4) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(fp8state.Linear(16, 16) for _ in range(n - 1)),
                          fp8state.LayerNormMLP(16, 32))
    _step(model)
    return model


def _step(model: nn.Module, scale: float = 1.0) -> None:
    with fp8state.fp8_autocast(fp8_recipe=fp8state.DelayedScaling(amax_history_len=8)):
        y = model(torch.randn(8, 16) * scale)
    y.sum().backward()


def _assert_payload_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key


def test_staged_payloads_equal_the_per_module_ones() -> None:
    model = _model()
    staged = model.state_dict()
    for i, module in enumerate(model):
        _assert_payload_equal(staged[f"{i}._extra_state"], pack(module.fp8_state()))


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
    snapshot = {k: v.clone() for k, v in first["0._extra_state"].items()}
    _step(model, scale=50.0)  # much larger amaxes: every used slot changes
    second = model.state_dict()
    _assert_payload_equal(first["0._extra_state"], snapshot)
    _assert_payload_equal(second["0._extra_state"], pack(model[0].fp8_state()))
    assert not torch.equal(second["0._extra_state"]["fwd.scale"], snapshot["fwd.scale"])


def test_direct_buffer_edits_are_never_hidden_by_a_staged_copy() -> None:
    model = _model()
    staging.stage(torch.device("cpu"))
    with torch.no_grad():
        model[1].fp8_meta("fwd").scale.fill_(3.0)  # bypasses the mixin's API
    assert torch.equal(model[1].get_extra_state()["fwd.scale"], torch.full((3,), 3.0))


def test_loads_moves_and_recipe_changes_invalidate() -> None:
    model = _model()
    other = _model()
    _step(other, scale=9.0)
    staging.stage(torch.device("cpu"))
    model[0].load_state_dict(other[0].state_dict())
    model[1].to("cpu", torch.bfloat16)  # buffers stay float32, but may be new tensors
    model[2].fp8_recipe = fp8state.DelayedScaling(amax_history_len=4)
    for module in list(model)[:3]:
        _assert_payload_equal(module.get_extra_state(), pack(module.fp8_state()))


def test_payloads_never_overlap_and_a_saved_state_dict_holds_each_byte_once(
    monkeypatch,
) -> None:
    model = _model()
    # Only this model's modules: a staging block holds every live module on the device.
    monkeypatch.setattr(staging, "_LIVE", weakref.WeakSet(model))
    sd = model.state_dict()
    tensors = [t for key, value in sd.items() if key.endswith("_extra_state")
               for t in value.values()]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start  # views into one block, but no two share a byte
    live = {t.untyped_storage().data_ptr() for m in model for d in ("fwd", "bwd")
            for t in m.fp8_meta(d)}
    assert not live & {t.untyped_storage().data_ptr() for t in tensors}
    buf = io.BytesIO()
    torch.save(sd, buf)
    everything = [*tensors, *(v for v in sd.values() if isinstance(v, torch.Tensor))]
    payload_bytes = sum(t.numel() * t.element_size() for t in everything)
    # The shared block is written once, not once per module (4 modules: 4x the bytes).
    assert buf.tell() < payload_bytes + 512 * len(everything)


def test_payload_is_handed_out_once() -> None:
    model = _model(2)
    a = model.state_dict()["0._extra_state"]
    b = model.state_dict()["0._extra_state"]
    assert a["fwd.scale"].untyped_storage().data_ptr() != b["fwd.scale"].untyped_storage(
    ).data_ptr()
    _assert_payload_equal(a, b)


def test_staging_one_device_keeps_the_entries_of_another(monkeypatch) -> None:
    model = _model(3)
    staging.stage(torch.device("cpu"))
    staging.stage(torch.device("cuda", 0))  # no module there: stages nothing, drops nothing
    calls = []
    real = staging.stage
    monkeypatch.setattr(staging, "stage", lambda device: (calls.append(device), real(device)))
    model.state_dict()
    assert calls == []  # every module took its payload staged before
