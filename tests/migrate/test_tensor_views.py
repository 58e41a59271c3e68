"""Tensors rebuilt from a checkpoint's storages lie inside the bytes the file holds: a view
past its storage's end, with negative numbers, or expanded to a size no storage backs (a
memory bomb on first use) is refused before anything is made, naming what it found; every
reader of pickled checkpoints goes through the same check."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from _helpers.cli import run_cli

from fp8state._te.rebuild import MAX_EXPANDED_ELEMENTS, check_view
from fp8state._te.unpickler import safe_torch_load
from fp8state.errors import LegacyFormatError
from fp8state.migrate import load_te_checkpoint

# Storages built by hand, as torch.save's own pickles hold them.
pytestmark = pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")


def _storage(elements: int, dtype: torch.dtype = torch.float32) -> torch.TypedStorage:
    return torch.zeros(elements, dtype=dtype).storage()


@pytest.mark.parametrize(
    ("offset", "size", "stride", "found"),
    [
        (10**6, (3,), (1,), "reaching byte"),
        (0, (4,), (1,), "reaching byte"),
        (2, (2,), (1,), "reaching byte"),
        (0, (2, 2), (2, 1), "reaching byte"),
        (-1, (1,), (1,), "offset -1"),
        (0, (-3,), (1,), "size"),
        (0, (3,), (-1,), "stride"),
        (0, (10**10, 3), (0, 1), "view of 30000000000 elements"),
    ],
    ids=["far-offset", "too-long", "tail", "2d", "neg-offset", "neg-size", "neg-stride", "bomb"],
)
def test_views_outside_their_storage_are_refused(
    offset: int, size: tuple, stride: tuple, found: str
) -> None:
    with pytest.raises(LegacyFormatError, match=found):
        check_view(_storage(3), offset, size, stride)


def test_views_inside_their_storage_pass() -> None:
    check_view(_storage(3), 0, (3,), (1,))
    check_view(_storage(6), 2, (2, 2), (2, 1))
    check_view(_storage(1), 0, (0, 5), (5, 1))  # empty
    check_view(_storage(1), 0, (1, 512), (512, 0))  # expanded within the limit
    check_view(_storage(2, torch.uint8), 0, (1,), (1,), torch.float16)  # v3's explicit dtype
    with pytest.raises(LegacyFormatError):
        check_view(_storage(2, torch.uint8), 0, (1,), (1,), torch.float32)
    assert MAX_EXPANDED_ELEMENTS == 2**24


class _View:
    """Pickles as torch.save pickles a tensor, with the view arguments given."""

    def __init__(self, offset: int, size: tuple, stride: tuple) -> None:
        self.args = (torch.zeros(3).storage(), offset, size, stride)

    def __reduce__(self) -> tuple:
        return (torch._utils._rebuild_tensor_v2, (*self.args, False, collections.OrderedDict()))


def _crafted(tmp_path: Path, offset: int, size: tuple, stride: tuple) -> Path:
    """A real torch.save file whose one tensor views its 3-element storage so."""
    path = tmp_path / "crafted.pt"
    torch.save({"w": _View(offset, size, stride)}, path)
    return path


@pytest.mark.parametrize(
    ("offset", "size", "stride"),
    [(10**6, (3,), (1,)), (0, (10**10, 3), (0, 1))],
    ids=["outside", "bomb"],
)
def test_every_reader_refuses_a_crafted_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], offset: int, size: tuple, stride: tuple
) -> None:
    path = _crafted(tmp_path, offset, size, stride)
    with pytest.raises(LegacyFormatError):
        safe_torch_load(str(path))
    with pytest.raises(LegacyFormatError):
        load_te_checkpoint(path)
    for command in (["inspect", str(path)], ["migrate", str(path), str(tmp_path / "o.pt")]):
        code, out, err = run_cli(capsys, *command)
        assert code == 1 and err.count("\n") == 1 and "storage" in err
    assert not (tmp_path / "o.pt").exists()
