"""docs/interop.md's python blocks run as written, in order, and leave what they promise; the
docstring examples of the conversion and plain-checkpoint modules pass."""

from __future__ import annotations

import doctest
import importlib
import re
import warnings
from pathlib import Path

import pytest
import torch
from _helpers.docs import python_blocks, run_blocks
from _helpers.paths import DOCS

DOC = DOCS / "interop.md"


def test_interop_doc_examples_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = python_blocks(DOC)
    assert len(blocks) == 4
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the examples are written to run without a warning
        namespace = run_blocks(blocks, "docs_interop", "interop.md")
    out = capsys.readouterr().out
    assert re.search(r"^head +torch\.nn\.Linear +unsupported +out_features=10 ", out, re.M)
    assert "FusedFrom(norm='ln_1', linear='qkv')" in out
    assert "['decoder.weight', 'ln_1.weight']" in out
    assert "['mlp.0._extra_state.bwd.amax_history', 'mlp.0._extra_state.bwd.scale']" in out
    for name in ("block.safetensors", "w.safetensors", "fp8.safetensors"):
        assert (tmp_path / name).stat().st_size > 0
    resumed, fused = namespace["resumed"], namespace["fused"]
    assert torch.equal(
        resumed.mlp[0].fp8_meta("bwd").amax_history,  # type: ignore[attr-defined]
        fused.mlp[0].fp8_meta("bwd").amax_history,
    )  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "name",
    [
        "fp8state.convert._swap",
        "fp8state.checkpoint.plain",
        "fp8state.checkpoint.plain_safetensors",
    ],
)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
