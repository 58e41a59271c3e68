"""Hash bombs: keys whose hashing never ends are refused before anything hashes them, by
fp8state's unpickler as it reads and by a dry run ahead of torch's weights-only reader;
valid keys of every kind a checkpoint holds still load."""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import struct
import warnings
import zipfile

import pytest
import torch

import fp8state
from fp8state._te.hash_budget import HashBudget
from fp8state._te.hash_scan import check_hash_cost
from fp8state._te.unpickler import load_storage_blob, loads
from fp8state.errors import CheckpointError, LegacyFormatError

from .corpus import tuple_dag

BOMBS = {
    "dict key": b"\x80\x02}" + tuple_dag(48) + b"K\x01s.",
    "dict opcode": b"\x80\x02(" + tuple_dag(48) + b"K\x01d.",
    "set element": b"\x80\x04\x8f(" + tuple_dag(48) + b"\x90.",
    "frozenset element": b"\x80\x04(" + tuple_dag(48) + b"\x91.",
    "OrderedDict pair": b"\x80\x02ccollections\nOrderedDict\n]"
    + tuple_dag(48)
    + b"K\x01\x86a\x85R.",
    "set call": b"\x80\x02c__builtin__\nset\n" + tuple_dag(48) + b"\x85\x85R.",
}


class _SetOf:
    """Pickles as ``set(items)``."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __reduce__(self) -> tuple:
        return (set, (self.items,))


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_unpickler_refuses_hash_bombs(name: str) -> None:
    with pytest.raises(LegacyFormatError, match="hashing visits over"):
        loads(BOMBS[name])


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_dry_run_refuses_hash_bombs(name: str) -> None:
    with pytest.raises(LegacyFormatError, match="hashing visits over"):
        check_hash_cost(BOMBS[name], "data.pkl")


def test_small_versions_of_the_bombs_load() -> None:
    small = b"\x80\x02}" + tuple_dag(3) + b"K\x01s."
    assert loads(small) == pickle.loads(small) == {tuple_dag_value(3): 1}
    check_hash_cost(small)


def test_repeated_large_key_is_charged_each_time() -> None:
    key = tuple(range(5000))
    data = pickle.dumps([{key: i} for i in range(400)], protocol=2)  # one key, memo-shared
    with pytest.raises(LegacyFormatError, match="hashing visits over"):
        loads(data)


def test_valid_keys_of_checkpoints_load() -> None:
    state = collections.OrderedDict(
        [("weight", torch.ones(2)), (("a", 1), 2.0), (3, {4, 5}), (torch.float32, None)]
    )
    assert loads(pickle.dumps(state, protocol=2)).keys() == state.keys()


def test_key_of_a_type_whose_hash_is_unknown_is_refused() -> None:
    with pytest.raises(LegacyFormatError, match="of type PurePosixPath"):
        HashBudget().charge(pathlib.PurePosixPath("a"))


def test_budget_counts_elements_and_int_digits() -> None:
    budget = HashBudget(limit=100)
    budget.charge(("a", (1, 2)))
    assert budget.left == 100 - 5
    budget.charge(1 << 640)  # 10 words of 64 bits
    assert budget.left == 100 - 5 - 11


def test_plain_load_dry_runs_before_torch_reads(tmp_path: pathlib.Path) -> None:
    buf = io.BytesIO()
    torch.save(_SetOf([tuple_dag_value(30)]), buf)
    buf.seek(0)
    with pytest.raises(CheckpointError, match="hashing visits over"):
        fp8state.checkpoint.load(buf)
    assert buf.tell() == 0


def test_nested_storage_blob_dry_runs_before_torch_reads() -> None:
    buf = io.BytesIO()
    torch.save(_SetOf([tuple_dag_value(30)]), buf, _use_new_zipfile_serialization=False)
    with pytest.raises(LegacyFormatError, match="hashing visits over"):
        load_storage_blob(buf.getvalue())


class _SkipPersistent(pickle.Unpickler):
    def persistent_load(self, pid: object) -> None:
        return None


def tuple_dag_value(depth: int) -> tuple:
    """The tuple :func:`tuple_dag` pickles, built in Python (building it hashes nothing)."""
    value: tuple = (1,)
    for _ in range(depth):
        value = (value, value)
    return value


def _archive(data_pkl: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return buf.getvalue()


# What torch's weights-only reader accepts and hashes, each a way past a naive dry run.
TORCH_READS = {
    "protocol 6 header": b"\x80\x06}" + tuple_dag(48) + b"K\x01s.",
    "UTF-8 string first": b"\x80\x02U\x02\xc3\xa90}" + tuple_dag(48) + b"K\x01s.",
    "Counter call": b"\x80\x02ccollections\nCounter\n]" + tuple_dag(48) + b"a\x85R.",
    "BUILD with pairs": b"\x80\x02ccollections\nOrderedDict\n)R]" + tuple_dag(48) + b"K\x01\x86ab.",
    "persistent id": b"\x80\x02(X\x07\x00\x00\x00storagectorch\nFloatStorage\n"
    + tuple_dag(48)
    + b"X\x03\x00\x00\x00cpuK\x00tQ.",
    "list arguments": b"\x80\x02c__builtin__\nset\n]]" + tuple_dag(48) + b"aaR.",
}


@pytest.mark.parametrize("name", sorted(TORCH_READS))
def test_plain_load_refuses_what_torch_would_hash(name: str) -> None:
    with pytest.raises(CheckpointError, match="hashing visits over"):
        fp8state.checkpoint.load(io.BytesIO(_archive(TORCH_READS[name])))


def test_plain_load_dry_runs_legacy_files_and_their_storage_keys() -> None:
    head = b"".join(pickle.dumps(v, 2) for v in (0x1950A86A20F9469CFC6C, 1001, {"x": 1}))
    as_object = head + b"\x80\x02}" + tuple_dag(48) + b"K\x01s." + pickle.dumps([], 2)
    as_key = head + pickle.dumps({}, 2) + b"\x80\x02]" + tuple_dag(48) + b"a."
    for data in (as_object, as_key):
        with pytest.raises(CheckpointError, match="hashing visits over"):
            fp8state.checkpoint.load(io.BytesIO(data))


def test_unpickler_refuses_calls_hashing_other_iterables_and_persistent_ids() -> None:
    deque_items = (
        b"\x80\x02c__builtin__\nset\nccollections\ndeque\n]" + tuple_dag(48) + b"a\x85R\x85R."
    )
    with pytest.raises(LegacyFormatError, match="items of a deque"):
        loads(deque_items)
    with pytest.raises(LegacyFormatError, match="hashing visits over"):
        loads(b"\x80\x02c__builtin__\nset\n]]" + tuple_dag(48) + b"aaR.")


def test_nested_blobs_share_the_loads_budget() -> None:
    zipped = _archive(b"\x80\x02}" + tuple_dag(48) + b"K\x01s.")  # a blob that is itself an archive
    call = b"\x80\x03ctorch.storage\n_load_from_bytes\nB" + struct.pack("<I", len(zipped))
    with pytest.raises(LegacyFormatError, match="hashing visits over"):
        loads(call + zipped + b"\x85R.")
    # A valid storage blob whose system-information pickle holds a key costing half the
    # budget, named ten times: each read alone passes, the load's one budget runs out.
    buf = io.BytesIO()
    with warnings.catch_warnings():  # TypedStorage: how TE's nested blobs were written
        warnings.simplefilter("ignore")
        torch.save(torch.ones(4).storage(), buf, _use_new_zipfile_serialization=False)
    raw, file, ends = buf.getvalue(), io.BytesIO(buf.getvalue()), [0]
    for _ in range(5):
        _SkipPersistent(file).load()
        ends.append(file.tell())
    info = b"\x80\x02}(X\x01\x00\x00\x00aK\x01u" + tuple_dag(18) + b"K\x01s."
    blob = raw[: ends[2]] + info + raw[ends[3] :]
    assert load_storage_blob(blob).nbytes() == 16
    many = b"\x80\x03ctorch.storage\n_load_from_bytes\nq\x01B" + struct.pack("<I", len(blob))
    many += blob + b"q\x02(" + b"h\x01h\x02\x85R" * 10 + b"l."
    with pytest.raises(LegacyFormatError, match="hashing visits over"):
        loads(many)


def test_errors_show_crafted_values_in_bounded_time() -> None:
    from fp8state._shown import shown

    assert len(shown(tuple_dag_value(60))) <= 120
    assert shown("\x1b]0;x\x07").isascii() and "\x1b" not in shown("\x1b]0;x\x07")
