"""The documentation runs: the python blocks of README.md and of the docs pages listed in
DOCS_WITH_CODE, executed as written (in order, one namespace per file, in a temporary
directory), and the docstring examples of the core modules. docs/migration.md and
docs/interop.md have tests of their own; test_docs_links.py checks that every page with python
blocks is run by one of them."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest
from _helpers.docs import DOCS_WITH_CODE, python_blocks, run_blocks
from _helpers.paths import DOCS, REPO_ROOT


@pytest.mark.parametrize("doc", DOCS_WITH_CODE)
def test_doc_code_blocks_run_unchanged(
    doc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = python_blocks(REPO_ROOT / doc)
    assert blocks, f"{doc} has no python code block"
    monkeypatch.chdir(tmp_path)
    run_blocks(blocks, f"docs_example_{Path(doc).stem}", doc)


def test_custom_module_example_is_a_two_gemm_mixin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fp8state

    monkeypatch.chdir(tmp_path)
    namespace = run_blocks(
        python_blocks(DOCS / "custom_modules.md"),
        "docs_example_custom_modules",
        "docs/custom_modules.md",
    )
    model = namespace["model"]
    assert isinstance(model, fp8state.FP8StateMixin) and model.fp8_num_gemms == 2
    # The example trained for real: every forward input/weight/output slot and the gradient
    # slots that exist in it hold amaxes.
    fwd_hist = model.fp8_meta("fwd").amax_history
    assert (fwd_hist[:5] > 0).all() and not fwd_hist[5:].any()
    bwd_hist = model.fp8_meta("bwd").amax_history
    assert (bwd_hist[:5, [0, 2, 3]] > 0).all()  # GEMM 0's grad_input: x needs no grad
    assert (tmp_path / "two_gemm.pt").is_file()


DOCTESTED_MODULES = [
    "errors",
    "formats",
    "recipe",
    "slots",
    "scaling",
    "schema",
    "mixin",
    "integrations.forward",
    "integrations.huggingface",
]


@pytest.mark.parametrize("name", DOCTESTED_MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(f"fp8state.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest failure(s) in fp8state.{name}"
