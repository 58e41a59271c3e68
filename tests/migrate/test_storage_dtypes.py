"""Checkpoints holding tensors of every dtype torch.save writes decode exactly: float8,
unsigned and bfloat16 tensors (stored with torch's untyped-storage marker) are not refused
as unsafe, and that marker can still never be called to allocate memory."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch
from _helpers.cli import run_cli

import fp8state
from fp8state._te.unpickler import loads
from fp8state.errors import LegacyFormatError
from fp8state.migrate import load_te_checkpoint, migrate_te_checkpoint

DTYPES = [
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bfloat16,
    torch.int8,
    torch.bool,
]


def _values(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([0.0, 1.0, 2.0, 3.0, 0.5 if dtype.is_floating_point else 1.0]).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_decodes_exactly(dtype: torch.dtype, tmp_path: Path) -> None:
    state = fp8state.Linear(16, 16).state_dict()
    state["weight_fp8"] = _values(dtype)
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)
    got = load_te_checkpoint(path)["weight_fp8"]
    assert got.dtype == dtype
    assert torch.equal(got.view(torch.uint8), _values(dtype).view(torch.uint8))  # bit for bit
    converted, report = migrate_te_checkpoint(path)
    assert torch.equal(converted["weight_fp8"].view(torch.uint8), got.view(torch.uint8))
    assert report.counts()  # a report, not a refusal


def test_inspect_reads_a_checkpoint_with_float8_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = fp8state.Linear(16, 16).state_dict()
    state["weight"] = state["weight"].to(torch.float8_e4m3fn)
    torch.save(state, tmp_path / "fp8.pt")
    code, out, err = run_cli(capsys, "inspect", str(tmp_path / "fp8.pt"))
    assert code == 0, err
    assert "1 FP8 module(s)" in out


def _calling_untyped_storage(opcode: str) -> bytes:
    """A protocol-2 pickle that calls torch.storage.UntypedStorage(10**12) (a terabyte)."""
    out = io.BytesIO()
    out.write(b"\x80\x02ctorch.storage\nUntypedStorage\n")
    if opcode == "REDUCE":
        out.write(pickle.LONG1 + b"\x06" + (10**12).to_bytes(6, "little") + pickle.TUPLE1)
        out.write(pickle.REDUCE)
    else:  # NEWOBJ: cls.__new__(cls, *args)
        out.write(pickle.LONG1 + b"\x06" + (10**12).to_bytes(6, "little") + pickle.TUPLE1)
        out.write(pickle.NEWOBJ)
    out.write(pickle.STOP)
    return out.getvalue()


@pytest.mark.parametrize("opcode", ["REDUCE", "NEWOBJ"])
def test_the_storage_marker_cannot_be_called(opcode: str) -> None:
    with pytest.raises(LegacyFormatError, match="calling torch.storage.UntypedStorage"):
        loads(_calling_untyped_storage(opcode))


def test_the_storage_marker_cannot_be_instantiated_by_protocol_0() -> None:
    data = b"(itorch.storage\nUntypedStorage\n."  # INST with no arguments
    with pytest.raises(LegacyFormatError, match="calling torch.storage.UntypedStorage"):
        loads(data)
