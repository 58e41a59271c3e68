"""Small files that ask for unbounded work end quickly and cleanly: lists sharing one another
48 deep (2**48 paths through a few hundred bytes), 100000 nested lists, a 200000-deep JSON
array in a safetensors header. Every reader answers within seconds: the file's contents, or
one FP8StateError."""

from __future__ import annotations

import struct
import time
import zipfile
from pathlib import Path

import pytest
import torch
from _helpers.cli import run_cli

from fp8state._walk import MAX_DEPTH, walk
from fp8state.errors import LegacyFormatError
from fp8state.migrate import load_te_checkpoint

SECONDS = 10  # generous for a 2-core CI machine; the walks themselves take milliseconds


def _shared_lists(depth: int) -> list:
    x: list = [torch.zeros(1)]
    for _ in range(depth):
        x = [x, x]
    return x


def test_shared_lists_are_walked_once_each(tmp_path: Path, capsys) -> None:
    path = tmp_path / "dag.pt"
    torch.save({"layer.weight": torch.ones(2), "layer.extra": _shared_lists(48)}, path)
    assert path.stat().st_size < 20_000
    start = time.perf_counter()
    state = load_te_checkpoint(path)
    code, _, err = run_cli(capsys, "migrate", str(path), str(tmp_path / "out.pt"))
    assert time.perf_counter() - start < SECONDS
    assert code == 0, err
    assert torch.equal(state["layer.weight"], torch.ones(2))


def _with_pickle(tmp_path: Path, data: bytes) -> Path:
    """A torch.save archive whose data.pkl is ``data``."""
    template = tmp_path / "template.pt"
    torch.save({}, template)
    out = tmp_path / "crafted.pt"
    with zipfile.ZipFile(template) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            body = data if info.filename.endswith("data.pkl") else src.read(info)
            dst.writestr(info, body)
    return out


def test_deeply_nested_lists_are_refused_cleanly(tmp_path: Path, capsys) -> None:
    depth = 100_000
    key = b"layer._extra_state"
    data = b"\x80\x02}X" + struct.pack("<I", len(key)) + key
    data += b"]" * depth + b"a" * (depth - 1) + b"s."
    path = _with_pickle(tmp_path, data)
    start = time.perf_counter()
    with pytest.raises(LegacyFormatError):
        load_te_checkpoint(path)
    for command in (["inspect", str(path)], ["migrate", str(path), str(tmp_path / "o.pt")]):
        code, out, err = run_cli(capsys, *command)
        assert code == 1 and out == "" and err.count("\n") == 1, err
    assert time.perf_counter() - start < SECONDS


def test_a_deep_json_header_is_not_a_traceback(tmp_path: Path, capsys) -> None:
    header = b"[" * 200_000 + b"]" * 200_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    code, out, err = run_cli(capsys, "inspect", str(path))
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "Traceback" not in err


def test_the_walker_visits_each_container_once_and_bounds_depth() -> None:
    shared = [1, 2]
    assert [p for p, _ in walk({"a": shared, "b": shared})] == [
        (),
        ("a",),
        ("a", 0),
        ("a", 1),
        ("b",),
    ]
    assert sum(1 for _ in walk(_shared_lists(60))) < 500
    deep: list = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(LegacyFormatError, match="nested more than"):
        for _ in walk(deep):
            pass
