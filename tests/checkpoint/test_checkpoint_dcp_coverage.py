"""A DCP checkpoint whose chunks do not tile a tensor exactly (a gap, an overlap, a chunk out
of bounds) is refused before anything is read, by every reader: consolidation would fill the
gap with uninitialized memory and report it validated, and a load into a model would keep the
model's old values there."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import fp8state
import fp8state.checkpoint as ckpt
from fp8state.checkpoint._metadata_checks import MAX_CHUNKS, check_coverage
from fp8state.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

KEY = "0.weight"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(fp8state.Linear(16, 16))


def _half(chunk: ChunkStorageMetadata) -> list[ChunkStorageMetadata]:
    return [dataclasses.replace(chunk, sizes=torch.Size([8, 16]))]


def _overlap(chunk: ChunkStorageMetadata) -> list[ChunkStorageMetadata]:
    top = dataclasses.replace(chunk, sizes=torch.Size([8, 16]))
    return [top, dataclasses.replace(top, offsets=torch.Size([4, 0])), top]


def _outside(chunk: ChunkStorageMetadata) -> list[ChunkStorageMetadata]:
    return [dataclasses.replace(chunk, offsets=torch.Size([1, 0]))]


def _negative(chunk: ChunkStorageMetadata) -> list[ChunkStorageMetadata]:
    return [dataclasses.replace(chunk, offsets=(-1, 0))]  # type: ignore[arg-type]


def _too_many(chunk: ChunkStorageMetadata) -> list[ChunkStorageMetadata]:
    return [chunk] * (MAX_CHUNKS + 1)


EDITS: dict[str, Callable[[ChunkStorageMetadata], list[Any]]] = {
    "gap": _half,
    "overlap": _overlap,
    "out-of-bounds": _outside,
    "negative": _negative,
    "too-many": _too_many,
}


def _edited(tmp_path: Path, edit: str) -> Path:
    folder = tmp_path / "dcp"
    dcp.save(_model().state_dict(), checkpoint_id=str(folder), no_dist=True)
    metadata = FileSystemReader(str(folder)).read_metadata()
    item = metadata.state_dict_metadata[KEY]
    item.chunks = EDITS[edit](item.chunks[0])
    with open(folder / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    return folder


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_tensor_not_covered_exactly_is_refused_by_every_reader(tmp_path: Path, edit: str) -> None:
    folder = _edited(tmp_path, edit)
    out = tmp_path / "out.pt"
    for trusted in (False, True):
        with pytest.raises(CheckpointError, match=KEY):
            ckpt.consolidate(folder, out, trusted=trusted)
        with pytest.raises(CheckpointError, match=KEY):
            ckpt.load_dcp_state_dict(folder, trusted=trusted)
        model = _model()
        before = model[0].weight.detach().clone()
        with pytest.raises(CheckpointError, match=KEY):
            ckpt.dcp_load(model, folder, trusted=trusted)
        assert torch.equal(model[0].weight, before)
    assert not out.exists()


def test_a_sharded_save_still_covers_exactly(tmp_path: Path) -> None:
    folder = tmp_path / "dcp"
    dcp.save(_model().state_dict(), checkpoint_id=str(folder), no_dist=True)
    metadata = FileSystemReader(str(folder)).read_metadata()
    item = metadata.state_dict_metadata[KEY]
    chunk = item.chunks[0]
    # Two row halves, as two ranks of FSDP write them: exact, no gap, no overlap.
    item.chunks = [
        dataclasses.replace(chunk, sizes=torch.Size([8, 16])),
        dataclasses.replace(chunk, offsets=torch.Size([8, 0]), sizes=torch.Size([8, 16])),
    ]
    check_coverage(metadata, folder)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("state_dict_metadata", 5),
        ("state_dict_metadata", {KEY: 5}),
        ("state_dict_metadata", {3: None}),
        ("planner_data", 7),
    ],
    ids=["items-not-a-dict", "item-not-metadata", "key-not-a-string", "planner-data"],
)
def test_metadata_fields_of_the_wrong_type_are_refused(
    tmp_path: Path, field: str, value: Any
) -> None:
    folder = tmp_path / "dcp"
    dcp.save(_model().state_dict(), checkpoint_id=str(folder), no_dist=True)
    metadata = FileSystemReader(str(folder)).read_metadata()
    setattr(metadata, field, value)
    with open(folder / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    for trusted in (False, True):
        with pytest.raises(CheckpointError, match=field):
            ckpt.read_dcp_metadata(folder, trusted=trusted)
        with pytest.raises(CheckpointError, match=field):
            ckpt.load_dcp_state_dict(folder, trusted=trusted)
        with pytest.raises(CheckpointError, match=field):
            ckpt.dcp_load(_model(), folder, trusted=trusted)
