"""Reading DCP folders of unknown origin: load_dcp_state_dict(trusted=False) reads what DCP's
own reader reads and runs nothing pickled; DCP read and consolidate failures are one-line
CheckpointErrors (the CLI prints them as they are)."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _helpers.dcp import replace_planner_data
from _helpers.state import assert_same, fields
from dist_workers import models
from te_gen.adversarial import Call

import fp8state
import fp8state.checkpoint as ckpt
from fp8state.checkpoint.dcp_untrusted import read_untrusted_metadata
from fp8state.cli import main
from fp8state.errors import CheckpointError, StateDictError, UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    """A DCP folder with FP8 extra states and the non-tensor items training scripts save."""
    model = models.trained("te", seed=3, salt=3)
    state = {
        "model": model.state_dict(),
        "epoch": 7,
        "blob": io.BytesIO(b"\x00raw"),
        "history": [torch.arange(3), 0.5, "text"],
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    return tmp_path / "dcp"


def test_untrusted_read_equals_dcps_own(mixed: Path) -> None:
    untrusted = ckpt.load_dcp_state_dict(mixed, trusted=False)
    assert_same(
        untrusted, ckpt.load_dcp_state_dict(mixed), ordered=True, exact_types=True, device="cpu"
    )
    assert untrusted["epoch"] == 7 and untrusted["history"][1:] == [0.5, "text"]
    assert fields(untrusted["model"]["mlp._extra_state"])["schema_version"].item() == 2


def test_untrusted_read_of_some_keys(mixed: Path) -> None:
    some = ckpt.load_dcp_state_dict(mixed, keys={"epoch", "blob"}, trusted=False)
    assert sorted(some) == ["blob", "epoch"] and some["blob"].getvalue() == b"\x00raw"


def test_crafted_metadata_is_refused_before_anything_runs(mixed: Path, tmp_path: Path) -> None:
    replace_planner_data(mixed, Call(os.system, f"touch {tmp_path / 'ran'}"))
    with pytest.raises(UnsafeCheckpointError, match="posix.system") as info:
        ckpt.load_dcp_state_dict(mixed, trusted=False)
    assert info.value.key == os.path.join(str(mixed), ".metadata")
    assert "Nothing was executed" in info.value.fix and not (tmp_path / "ran").exists()


def test_crafted_item_is_refused_before_anything_runs(tmp_path: Path) -> None:
    folder, marker = tmp_path / "dcp", tmp_path / "ran"
    dcp.save(
        {"w": torch.ones(2), "evil": Call(os.system, f"touch {marker}")},
        checkpoint_id=str(folder),
        no_dist=True,
    )
    with pytest.raises(UnsafeCheckpointError, match="posix.system") as info:
        ckpt.load_dcp_state_dict(folder, trusted=False)
    assert info.value.key == f"{folder}/evil" and not marker.exists()


@pytest.mark.parametrize(
    "paths",
    [
        pytest.param({"w": ("w", 10**12)}, id="huge-list-index"),
        pytest.param({"w": ()}, id="empty-path"),
        pytest.param({"w": ("a",), "v": ("a",)}, id="two-items-one-path"),
        pytest.param({"w": ("a", "b"), "v": ("a",)}, id="item-over-a-dict"),
        pytest.param({"w": ("w",), "v": ("w", "x")}, id="item-inside-a-tensor"),
    ],
)
def test_crafted_item_paths_are_refused(tmp_path: Path, paths: dict[str, Any]) -> None:
    folder = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2), "v": torch.zeros(1)}, checkpoint_id=str(folder), no_dist=True)
    replace_planner_data(folder, paths)
    with pytest.raises(CheckpointError, match="item paths that do not nest"):
        ckpt.load_dcp_state_dict(folder, trusted=False)


def test_damaged_metadata_and_items(mixed: Path) -> None:
    shard = next(p for p in mixed.iterdir() if p.suffix == ".distcp")
    blob = shard.read_bytes()
    shard.write_bytes(b"\x80\x02garbage" * 100)  # every item's bytes are now garbage
    with pytest.raises(CheckpointError, match="damaged"):
        ckpt.load_dcp_state_dict(mixed, trusted=False)
    shard.write_bytes(blob)
    (mixed / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CheckpointError, match="unreadable metadata file"):
        ckpt.load_dcp_state_dict(mixed, trusted=False)


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "untrusted"])
def test_missing_shard_is_one_line(mixed: Path, trusted: bool) -> None:
    next(p for p in mixed.iterdir() if p.suffix == ".distcp").unlink()
    with pytest.raises(CheckpointError, match="missing or damaged") as info:
        ckpt.load_dcp_state_dict(mixed, trusted=trusted)
    assert "\n" not in str(info.value) and "FileNotFoundError" in info.value.found


def test_cli_consolidate_reports_a_missing_shard_in_one_line(
    mixed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    next(p for p in mixed.iterdir() if p.suffix == ".distcp").unlink()
    assert main(["consolidate", str(mixed), str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "missing or damaged" in err


def test_cli_consolidate_names_a_refused_object_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "dcp"
    dcp.save(
        {"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)},
        checkpoint_id=str(folder),
        no_dist=True,
    )
    # By default the allow-list refuses it, before anything is unpickled, and names the opt-in.
    assert main(["consolidate", str(folder), str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argparse.Namespace" in err and "--trusted" in err
    assert not (tmp_path / "out.pt").exists()
    # Trusted, DCP's reader unpickles it; the file written must load weights-only: refused.
    assert main(["consolidate", str(folder), str(tmp_path / "out.pt"), "--trusted"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refuses (argparse.Namespace)" in err
    assert not (tmp_path / "out.pt").exists()


def test_dcp_load_reports_a_missing_shard_in_one_line(tmp_path: Path) -> None:
    ckpt.dcp_save(models.build("te", seed=3), tmp_path / "dcp")
    next(p for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp").unlink()
    with pytest.raises(CheckpointError, match="missing or damaged") as info:
        ckpt.dcp_load(models.build("te", seed=4), tmp_path / "dcp")
    assert "\n" not in str(info.value) and "FileNotFoundError" in info.value.found


def _build_on_global(module: str, name: str) -> bytes:
    """A protocol-2 pickle: GLOBAL module.name, then BUILD (None, {"pwned": "yes"}): plain
    pickle sets the attribute on the class or function itself, for the whole process."""
    return (
        b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n"
        b"N}X\x05\x00\x00\x00pwnedX\x03\x00\x00\x00yes" + b"s\x86b."
    )


@pytest.mark.parametrize(
    ("module", "name", "owner"),
    [
        ("torch.distributed.checkpoint.metadata", "Metadata", dcp.metadata.Metadata),
        ("pathlib", "PosixPath", __import__("pathlib").PosixPath),
        ("torch", "Size", torch.Size),
    ],
    ids=["Metadata", "PosixPath", "Size"],
)
def test_metadata_cannot_set_attributes_on_allowed_classes(
    mixed: Path, module: str, name: str, owner: type
) -> None:
    (mixed / ".metadata").write_bytes(_build_on_global(module, name))
    with pytest.raises(UnsafeCheckpointError, match="state of a type object") as info:
        ckpt.load_dcp_state_dict(mixed, trusted=False)
    assert info.value.key == os.path.join(str(mixed), ".metadata")
    assert not hasattr(owner, "pwned")


def test_metadata_state_must_name_the_dataclass_fields(mixed: Path) -> None:
    # NEWOBJ Metadata, then BUILD ({"state_dict_metadata": {}, "__class__": 1}, None).
    data = (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81"
        b"}X\x13\x00\x00\x00state_dict_metadata}sX\t\x00\x00\x00__class__K\x01sN\x86b."
    )
    (mixed / ".metadata").write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match="__class__"):
        ckpt.load_dcp_state_dict(mixed, trusted=False)


def test_metadata_made_without_its_fields_is_refused(mixed: Path) -> None:
    # NEWOBJ Metadata and nothing more: an instance whose __init__ never ran.
    data = b"ctorch.distributed.checkpoint.metadata\nMetadata\nX\x05\x00\x00\x00pwned\x81."
    (mixed / ".metadata").write_bytes(data)
    with pytest.raises(CheckpointError, match="a Metadata without its field") as info:
        ckpt.load_dcp_state_dict(mixed, trusted=False)
    assert info.value.key == os.path.join(str(mixed), ".metadata")
    assert "state_dict_metadata" in info.value.found


def test_an_item_made_without_its_fields_is_refused(mixed: Path) -> None:
    # A real folder's metadata with one tensor's entry replaced by a bare instance: the
    # storage data stays valid, so only the item itself is wrong.
    with open(mixed / ".metadata", "rb") as file:
        metadata = pickle.load(file)
    key = next(k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks"))
    bare = object.__new__(type(metadata.state_dict_metadata[key]))
    metadata.state_dict_metadata[key] = bare
    with open(mixed / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    model = models.build("te", seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="chunks, properties, size"):
        ckpt.load_dcp_state_dict(mixed, trusted=False)
    with pytest.raises(CheckpointError, match="TensorStorageMetadata without its field"):
        ckpt.dcp_load(model, mixed)
    assert_same(model.state_dict(), before)


def test_a_field_with_a_default_factory_reads_as_its_default(mixed: Path) -> None:
    # As a torch from before StorageMeta.modules wrote it: the field is not in the pickle.
    with open(mixed / ".metadata", "rb") as file:
        metadata = pickle.load(file)
    del vars(metadata.storage_meta)["modules"]
    with open(mixed / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    assert read_untrusted_metadata(str(mixed)).storage_meta.modules == []
    untrusted = ckpt.load_dcp_state_dict(mixed, trusted=False)
    assert_same(untrusted, ckpt.load_dcp_state_dict(mixed, trusted=True), exact_types=True)


def _gadget_folders(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    """Folders whose .metadata, or whose non-tensor item, runs `touch MARKER` when unpickled
    by plain pickle; each with its own marker file."""
    model = torch.nn.Sequential(fp8state.Linear(16, 16))
    out = {}
    for where in ("metadata", "item"):
        folder, marker = tmp_path / where, tmp_path / f"ran-{where}"
        state: dict[str, Any] = dict(model.state_dict())
        if where == "item":
            state["0.weight"] = Call(os.system, f"touch {marker}")  # where a tensor belongs
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
        if where == "metadata":
            replace_planner_data(folder, Call(os.system, f"touch {marker}"))
        out[where] = (folder, marker)
    return out


@pytest.mark.parametrize("where", ["metadata", "item"])
def test_every_reader_is_safe_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    folder, marker = _gadget_folders(tmp_path)[where]
    model = torch.nn.Sequential(fp8state.Linear(16, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = tmp_path / "out.pt"
    assert main(["consolidate", str(folder), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Nothing was executed" in err and "--trusted" in err
    with pytest.raises(UnsafeCheckpointError):
        ckpt.consolidate(folder, out)
    with pytest.raises(UnsafeCheckpointError):
        ckpt.load_dcp_state_dict(folder)
    with pytest.raises((UnsafeCheckpointError, StateDictError)):
        ckpt.dcp_load(model, folder)
    if where == "metadata":
        with pytest.raises(UnsafeCheckpointError):
            ckpt.read_dcp_metadata(folder)
    assert not marker.exists() and not out.exists()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def _point_items_at(folder: Path, relative_path: str, offset: int = 0) -> None:
    """Rewrite .metadata so that every item is read from ``relative_path`` at ``offset``."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()  # a folder this test wrote
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = dataclasses.replace(
            info, relative_path=relative_path, offset=offset
        )
    with open(folder / ".metadata", "wb") as file:
        pickle.dump(metadata, file)


@pytest.mark.parametrize(
    "where",
    ["/dev/zero", "../outside.distcp", "sub/../../outside.distcp", "link.distcp", "sub"],
    ids=["absolute", "parent", "parent-deep", "link-out", "a-folder"],
)
def test_storage_paths_outside_the_folder_are_refused_before_opening(
    mixed: Path, tmp_path: Path, where: str
) -> None:
    (tmp_path / "outside.distcp").write_bytes(b"\0" * 10**6)
    (mixed / "link.distcp").symlink_to(tmp_path / "outside.distcp")
    (mixed / "sub").mkdir()
    _point_items_at(mixed, where)
    with pytest.raises(UnsafeCheckpointError, match="inside the checkpoint folder"):
        ckpt.load_dcp_state_dict(mixed)
    with pytest.raises(UnsafeCheckpointError, match="inside the checkpoint folder"):
        ckpt.dcp_load(models.build("te", seed=4), mixed)


def test_an_item_past_the_end_of_its_shard_is_damage(mixed: Path) -> None:
    shard = next(p for p in mixed.iterdir() if p.suffix == ".distcp")
    _point_items_at(mixed, shard.name, offset=shard.stat().st_size)
    with pytest.raises(CheckpointError, match="missing or damaged") as info:
        ckpt.load_dcp_state_dict(mixed)
    assert "EOFError" in info.value.found
