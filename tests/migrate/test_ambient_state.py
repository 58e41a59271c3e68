"""Decoding does not depend on the caller's ambient torch state: every TE fixture, and
fp8state's own files of both schema versions, decode to the same tensors (dtype, device,
values) inside ``with torch.device("meta")`` (the usual pattern for building a large model
before loading it) and under ``torch.set_default_dtype(torch.float64)`` or ``float16``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers.paths import FIXTURES

import fp8state
from fp8state.migrate import load_te_checkpoint, migrate_te_checkpoint
from fp8state.migrate.summary import summarize_checkpoint
from fp8state.schema import default_payload

TE_FILES = sorted((FIXTURES / "te_legacy").glob("te_*.pt")) + sorted(
    (FIXTURES / "te_real_2.20").glob("*.pt")
)
OWN_FILES = sorted((FIXTURES / "schema").glob("*.pt"))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


AMBIENT: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "meta-device": lambda: torch.device("meta"),
    "float64-default": lambda: _default_dtype(torch.float64),
    "float16-default": lambda: _default_dtype(torch.float16),
}


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape), where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("ambient", sorted(AMBIENT))
@pytest.mark.parametrize("path", TE_FILES, ids=lambda p: p.stem)
def test_te_checkpoints_decode_the_same_whatever_the_defaults(path: Path, ambient: str) -> None:
    want = load_te_checkpoint(path)
    want_report = migrate_te_checkpoint(path)[1].to_dict()
    want_summary = summarize_checkpoint(path).to_dict()
    with AMBIENT[ambient]():
        got = load_te_checkpoint(path)
        got_report = migrate_te_checkpoint(path)[1].to_dict()
        got_summary = summarize_checkpoint(path).to_dict()
    _assert_same(want, got)
    assert got_report == want_report
    assert got_summary == want_summary


@pytest.mark.parametrize("ambient", sorted(AMBIENT))
@pytest.mark.parametrize("path", OWN_FILES, ids=lambda p: p.stem)
def test_own_checkpoints_load_the_same_whatever_the_defaults(path: Path, ambient: str) -> None:
    want = fp8state.checkpoint.load(path)
    with AMBIENT[ambient]():
        got = fp8state.checkpoint.load(path)
    _assert_same(want, got)


@pytest.mark.parametrize("ambient", sorted(AMBIENT))
def test_a_fresh_payload_is_float32_on_the_cpu_whatever_the_defaults(ambient: str) -> None:
    want = default_payload(num_gemms=2, rows=8)
    with AMBIENT[ambient]():
        got = default_payload(num_gemms=2, rows=8)
    _assert_same(want, got)
