"""A corpus of hostile checkpoints, one builder per class of attack, each written to a folder.

Every gadget, were it unpickled by plain ``pickle``, would create the file ``SENTINEL`` in
the folder it is built in. Builders return the path to read (a file or a DCP folder); what a
reader must do with it is in :data:`CORPUS`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from te_gen.adversarial import PLACES, Call
from torch.distributed.checkpoint.filesystem import FileSystemReader

import fp8state

SENTINEL = "SENTINEL"
# Keys a terminal would act on: a title change, a colour, a CR, a forged line, a bidi override.
HOSTILE_KEY = "blocks.0\x1b]0;owned\x07\x1b[31m\rok\nwrote model.pt\u202e"


def _gadget(folder: Path) -> Call:
    return Call(os.system, f"touch {folder / SENTINEL}")


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return dict(fp8state.Linear(16, 16).state_dict())


def _save(folder: Path, obj: object) -> Path:
    path = folder / "ckpt.pt"
    torch.save(obj, path)
    return path


def _dcp(folder: Path, state: dict[str, Any] | None = None) -> Path:
    path = folder / "dcp"
    dcp.save(state if state is not None else _state(), checkpoint_id=str(path), no_dist=True)
    return path


def _rewrite_metadata(path: Path, edit: Callable[[Any], None]) -> Path:
    metadata = FileSystemReader(str(path)).read_metadata()  # a folder this module wrote
    edit(metadata)
    with open(path / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    return path


class _View:
    """Pickles as a tensor viewing its 3-element storage with the given arguments."""

    def __init__(self, offset: int, size: tuple, stride: tuple) -> None:
        self.args = (torch.zeros(3).storage(), offset, size, stride)

    def __reduce__(self) -> tuple:
        return (torch._utils._rebuild_tensor_v2, (*self.args, False, collections.OrderedDict()))


class _ParameterWithHooks:
    def __reduce__(self) -> tuple:
        hooks = {"_backward_hooks": collections.OrderedDict([(0, torch.Size)])}
        return (
            torch._utils._rebuild_parameter_with_state,
            (torch.ones(2), True, collections.OrderedDict(), hooks),
        )


def gadget_outer(folder: Path) -> Path:
    return _save(folder, {**_state(), "evil": _gadget(folder)})


def gadget_extra_state(folder: Path) -> Path:
    return _save(folder, {**_state(), "_extra_state": PLACES["uint8-pickle"](_gadget(folder))})


def gadget_storage_blob(folder: Path) -> Path:
    state = {**_state(), "_extra_state": PLACES["nested-storage-blob"](_gadget(folder))}
    return _save(folder, state)


def view_outside_storage(folder: Path) -> Path:
    return _save(folder, {**_state(), "bias": _View(10**6, (3,), (1,))})


def stride_bomb(folder: Path) -> Path:
    return _save(folder, {**_state(), "bias": _View(0, (10**10, 3), (0, 1))})


def _rewrite_data_pkl(path: Path, edit: Callable[[bytes], bytes]) -> Path:
    """Replace the pickle of the torch.save archive at ``path`` with ``edit(pickle)``."""
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
        files = {info.filename: archive.read(info) for info in infos}
    name = next(n for n in files if n.endswith("data.pkl"))
    files[name] = edit(files[name])
    with zipfile.ZipFile(path, "w") as archive:
        for info in infos:
            archive.writestr(info, files[info.filename])
    return path


def storage_claims_terabytes(folder: Path) -> Path:
    """A zip archive whose storage record says 10**12 elements; the record holds 64 bytes."""

    def claim(data: bytes) -> bytes:
        numel = data.index(b"K\x10t")  # the storage's element count in its persistent id
        huge = b"\x8a\x06" + (10**12).to_bytes(6, "little")
        return data[:numel] + huge + data[numel + 2 :]

    return _rewrite_data_pkl(_save(folder, {"bias": torch.zeros(16)}), claim)


def shadowing_state_dict(folder: Path) -> Path:
    state = collections.OrderedDict(_state())
    state.__dict__["keys"] = "shadow"
    return _save(folder, state)


def parameter_with_hooks(folder: Path) -> Path:
    return _save(folder, {**_state(), "weight": _ParameterWithHooks()})


def hostile_keys(folder: Path) -> Path:
    return _save(folder, {f"{HOSTILE_KEY}.{k}": v for k, v in _state().items()})


def dcp_metadata_gadget(folder: Path) -> Path:
    path = _dcp(folder)

    def edit(metadata: Any) -> None:
        metadata.planner_data = _gadget(folder)

    return _rewrite_metadata(path, edit)


def dcp_item_gadget(folder: Path) -> Path:
    return _dcp(folder, {**_state(), "weight": _gadget(folder)})


def dcp_path_traversal(folder: Path) -> Path:
    path = _dcp(folder)

    def edit(metadata: Any) -> None:
        for index, info in metadata.storage_data.items():
            metadata.storage_data[index] = dataclasses.replace(info, relative_path="/dev/zero")

    return _rewrite_metadata(path, edit)


def dcp_uncovered_chunks(folder: Path) -> Path:
    path = _dcp(folder)

    def edit(metadata: Any) -> None:
        item = metadata.state_dict_metadata["weight"]
        item.chunks = [dataclasses.replace(item.chunks[0], sizes=torch.Size([8, 16]))]

    return _rewrite_metadata(path, edit)


def dcp_item_without_fields(folder: Path) -> Path:
    path = _dcp(folder)

    def edit(metadata: Any) -> None:
        # An instance whose __init__ never ran: pickled as NEWOBJ with no BUILD.
        kind = type(metadata.state_dict_metadata["weight"])
        metadata.state_dict_metadata["weight"] = object.__new__(kind)

    return _rewrite_metadata(path, edit)


def dcp_build_on_class(folder: Path) -> Path:
    path = _dcp(folder)
    # GLOBAL Metadata, BUILD (None, {"pwned": "yes"}): sets an attribute on the class itself.
    (path / ".metadata").write_bytes(
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"
        b"N}X\x05\x00\x00\x00pwnedX\x03\x00\x00\x00yes" + b"s\x86b."
    )
    return path


def tuple_dag(depth: int) -> bytes:
    """Pickle opcodes pushing a tuple that holds the one below twice, ``depth`` deep.

    A few bytes per level (the memo shares each level); hashing the result visits 2**depth
    leaves. Memo slots 0 to ``depth`` are used.
    """
    out = b"K\x01\x85q\x00"  # (1,), memo 0, left on the stack
    for level in range(depth):  # (top, memo copy of top)
        out += b"h" + bytes([level]) + b"\x86q" + bytes([level + 1])
    return out


def hash_bomb_key(folder: Path) -> Path:
    """A torch.save archive whose pickle is a dict keyed by a 48-deep shared tuple."""
    path = _save(folder, {"bias": torch.zeros(2)})
    return _rewrite_data_pkl(path, lambda _: b"\x80\x02}" + tuple_dag(48) + b"K\x01s.")


def dcp_hash_bomb_key(folder: Path) -> Path:
    """``.metadata`` whose ``state_dict_metadata`` is keyed by a 48-deep shared tuple."""
    path = _dcp(folder)
    (path / ".metadata").write_bytes(
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}"
        b"X\x13\x00\x00\x00state_dict_metadata}" + tuple_dag(48) + b"K\x01ssb."
    )
    return path


#: name -> (builder, "file" or "dcp", refused: whether every reader must refuse it).
CORPUS: dict[str, tuple[Callable[[Path], Path], str, bool]] = {
    "gadget-outer": (gadget_outer, "file", True),
    "gadget-extra-state": (gadget_extra_state, "file", True),
    "gadget-storage-blob": (gadget_storage_blob, "file", True),
    "view-outside-storage": (view_outside_storage, "file", True),
    "stride-bomb": (stride_bomb, "file", True),
    "storage-claims-terabytes": (storage_claims_terabytes, "file", True),
    "shadowing-state-dict": (shadowing_state_dict, "file", True),
    "parameter-with-hooks": (parameter_with_hooks, "file", True),
    "hostile-keys": (hostile_keys, "file", False),
    "dcp-metadata-gadget": (dcp_metadata_gadget, "dcp", True),
    "dcp-item-gadget": (dcp_item_gadget, "dcp", True),
    "dcp-path-traversal": (dcp_path_traversal, "dcp", True),
    "dcp-uncovered-chunks": (dcp_uncovered_chunks, "dcp", True),
    "dcp-item-without-fields": (dcp_item_without_fields, "dcp", True),
    "dcp-build-on-class": (dcp_build_on_class, "dcp", True),
    "hash-bomb-key": (hash_bomb_key, "file", True),
    "dcp-hash-bomb-key": (dcp_hash_bomb_key, "dcp", True),
}
