"""fp8state.checkpoint.load: weights only, onto the CPU, and an error that says why otherwise."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _helpers.paths import FIXTURES
from _helpers.state import assert_same
from dist_workers import models
from te_gen.adversarial import Call

import fp8state.checkpoint as ckpt
from fp8state.errors import CheckpointError, LegacyFormatError, UnsafeCheckpointError


@contextlib.contextmanager
def saved_as_if_on(location: str) -> Iterator[None]:
    """Make ``torch.save`` tag CPU storages with ``location`` (e.g. ``"cuda:0"``).

    A CPU-only machine can then write the file a GPU run writes: the tag is all that differs.
    """

    def tagger(storage: object) -> str | None:
        return location if getattr(storage, "device", None) == torch.device("cpu") else None

    def never_restore(storage: object, tag: str) -> None:
        return None  # fall through to torch's own deserializers

    torch.serialization.register_package(0, tagger, never_restore)
    try:
        yield
    finally:
        torch.serialization._package_registry[:] = [
            entry for entry in torch.serialization._package_registry if entry[1] is not tagger
        ]


def _saved(tmp_path: Path, obj: object, name: str = "ckpt.pt") -> Path:
    path = tmp_path / name
    torch.save(obj, path)
    return path


@pytest.mark.parametrize("kind", models.KINDS)
def test_round_trip_onto_cpu(tmp_path: Path, kind: str) -> None:
    model = models.trained(kind, seed=1, salt=1)
    state = ckpt.load(_saved(tmp_path, model.state_dict()))
    tensors = [t for v in state.values() for t in (v.values() if isinstance(v, dict) else [v])]
    assert {t.device.type for t in tensors} == {"cpu"}
    fresh = models.build(kind, seed=2)
    ckpt.load_state_dict(fresh, state)
    assert_same(models.full_state(fresh), models.full_state(model))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure it contrasts with needs no CUDA")
def test_file_saved_on_cuda_0_loads_on_a_machine_without_cuda(tmp_path: Path) -> None:
    model = models.build(seed=1)
    models.fill_fp8(model, salt=1)
    with saved_as_if_on("cuda:0"):
        path = _saved(tmp_path, model.state_dict())
    with pytest.raises(RuntimeError, match="CUDA"):  # plain torch restores onto cuda:0
        torch.load(path, weights_only=True)
    state = ckpt.load(path)
    assert state["inp.weight"].device.type == "cpu"
    assert state["inp._extra_state"].device.type == "cpu"
    with pytest.raises(CheckpointError, match="map_location") as info:
        ckpt.load(path, map_location=None)
    assert info.value.key == str(path)


def test_file_object_and_map_location_pass_through() -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, buf)
    buf.seek(0)
    out = ckpt.load(buf, map_location=torch.device("meta"))
    assert out["w"].device.type == "meta"


def _te_payload(value: object) -> dict[str, object]:
    return {"proj.weight": torch.zeros(2, 2), "proj._extra_state": value}


_PICKLED_NONE = torch.frombuffer(bytearray(pickle.dumps(None)), dtype=torch.uint8)


@pytest.mark.parametrize(
    "value,era",
    [
        pytest.param(_PICKLED_NONE, "pickled bytes", id="uint8-pickle"),
        pytest.param(torch.empty(0, dtype=torch.uint8), "empty uint8", id="empty-uint8"),
        pytest.param([torch.ones(3)] * 4 + [{}, True, 0, 0, 1, 1], "list of 10", id="list"),
        pytest.param(
            {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(4, 3)},
            "dict of TransformerEngine",
            id="dict",
        ),
        pytest.param(None, "None", id="none"),
    ],
)
def test_transformer_engine_extra_state_points_at_migrate(
    tmp_path: Path, value: object, era: str
) -> None:
    path = _saved(tmp_path, _te_payload(value))
    with pytest.raises(LegacyFormatError, match="fp8state migrate") as info:
        ckpt.load(path)
    assert "proj._extra_state" in info.value.key
    assert era in info.value.found


def test_transformer_engine_bytesio_file_points_at_migrate(tmp_path: Path) -> None:
    path = _saved(tmp_path, _te_payload(io.BytesIO(b"\x80\x04N.")))
    with pytest.raises(LegacyFormatError, match="fp8state migrate") as info:
        ckpt.load(path)
    assert "BytesIO" in info.value.found


def test_nested_checkpoint_names_the_full_key(tmp_path: Path) -> None:
    path = _saved(tmp_path, {"model": _te_payload(_PICKLED_NONE), "step": 3})
    with pytest.raises(LegacyFormatError) as info:
        ckpt.load(path)
    assert "model.proj._extra_state" in info.value.key


def test_other_libraries_extra_state_is_left_alone(tmp_path: Path) -> None:
    state = {"x._extra_state": torch.ones(2), "y._extra_state": {"mine": torch.ones(1)}}
    loaded = ckpt.load(_saved(tmp_path, state))
    assert ckpt.find_legacy_extra_states(loaded) == {}


def test_pickled_code_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = _saved(tmp_path, {"weight": torch.ones(1), "evil": Call(os.system, f"touch {marker}")})
    with pytest.raises(UnsafeCheckpointError) as info:
        ckpt.load(path)
    assert "system" in info.value.found
    assert "fp8state migrate" in info.value.fix
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 not really a zip"], ids=["empty", "junk"])
def test_corrupt_file_is_a_checkpoint_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        ckpt.load(path)


def test_truncated_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = _saved(tmp_path, models.build().state_dict())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        ckpt.load(path)


def test_folders_are_refused_with_the_right_pointer(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning, match="single process"):  # DCP's note, not ours
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    with pytest.raises(CheckpointError, match="consolidate"):
        ckpt.load(tmp_path / "dcp")
    (tmp_path / "plain").mkdir()
    with pytest.raises(CheckpointError, match="a folder"):
        ckpt.load(tmp_path / "plain")
    with pytest.raises(FileNotFoundError):
        ckpt.load(tmp_path / "missing.pt")


#: The vendored TE fixtures (tests/fixtures/README.md): ten legacy eras and three real TE 2.20.
_TE_FILES = sorted([*FIXTURES.glob("te_legacy/te_E*.pt"), *FIXTURES.glob("te_real*/*.pt")])
assert len(_TE_FILES) == 13, f"TE fixtures missing at {FIXTURES}"


@pytest.mark.parametrize("path", _TE_FILES, ids=[p.name for p in _TE_FILES])
def test_every_transformer_engine_fixture_points_at_migrate(path: Path) -> None:
    with pytest.raises(LegacyFormatError, match="fp8state migrate"):
        ckpt.load(path)
