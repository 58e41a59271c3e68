"""Hash bombs: keys whose hashing never ends are refused before anything hashes them, by
fp8state's unpickler as it reads and by a dry run ahead of torch's weights-only reader;
valid keys of every kind a checkpoint holds still load."""

from __future__ import annotations

import collections
import io
import pathlib
import pickle

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


def tuple_dag_value(depth: int) -> tuple:
    """The tuple :func:`tuple_dag` pickles, built in Python (building it hashes nothing)."""
    value: tuple = (1,)
    for _ in range(depth):
        value = (value, value)
    return value
