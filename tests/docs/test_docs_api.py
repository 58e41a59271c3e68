"""docs/api.md is what docs/gen_api.py renders from the code, and its examples run.

The doctests are those of the objects the reference shows (the sections' modules and every
public name), run with the standard ``doctest`` module, each in a fresh namespace (examples
import what they use) and a temporary working directory.
"""

from __future__ import annotations

import difflib
import doctest
import importlib.util
import inspect
import io
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from _helpers.paths import DOCS


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


GEN = _generator()
OBJECTS = dict(GEN.doctest_objects())

#: Public names whose own docstring has no example, and where the example that shows them is.
NO_EXAMPLE = {
    "fp8state.is_fp8_enabled": "docs/concepts.md (fp8_autocast's contexts)",
    "fp8state.CalibrationReport": "returned by fp8state.recalibrate, whose example reads it",
    "fp8state.checkpoint.ConsolidateResult": "returned by consolidate, whose example reads it",
    "fp8state.checkpoint.DCPEntry": "returned by read_dcp_metadata, whose example prints it",
    "fp8state.checkpoint.StateDictError": "raised in load_state_dict's example",
    "fp8state.migrate.DecodedExtraState": "returned by decode_te_value, whose example reads it",
    "fp8state.migrate.MigrationReport": "returned by migrate_te_checkpoint (its example)",
    "fp8state.migrate.EntryReport": "listed in migrate_te_checkpoint's example",
    "fp8state.errors.RecipeError": "raised in FP8StateError's example",
    "fp8state.errors.SchemaError": "raised in fp8state.schema.unpack's example",
    "fp8state.errors.LegacyFormatError": "docs/faq.md (a TransformerEngine checkpoint)",
    "fp8state.errors.UnsafeCheckpointError": "docs/checkpoints.md (files you did not write)",
    "fp8state.errors.CheckpointError": "raised in fp8state.checkpoint.load_state_dict's example",
    "fp8state.errors.StateDictError": "raised in fp8state.checkpoint.load_state_dict's example",
    "fp8state.errors.DistributedStateError": "needs several ranks: docs/checkpoints.md",
    "fp8state.errors.ConversionError": "docs/interop.md (convert_model's rules)",
    "fp8state.errors.ConfigError": "docs/faq.md (GPU requirements)",
    "fp8state.schema.DirectionState": "read in FP8State's example",
    "fp8state.backends.scaled_mm_support": "docs/faq.md (GPU requirements)",
    "fp8state.backends.resolve_backend": "docs/faq.md (GPU requirements)",
    "fp8state.backends.fp8_gemm": "called by fp8state.functional.fp8_linear (its example)",
}


def test_api_reference_is_up_to_date() -> None:
    rendered = GEN.render()
    current = (DOCS / "api.md").read_text()
    if current != rendered:
        diff = difflib.unified_diff(
            current.splitlines(), rendered.splitlines(), "docs/api.md", "rendered", lineterm="", n=1
        )
        shown = "\n".join(list(diff)[:40])
        pytest.fail(f"docs/api.md is out of date: run python docs/gen_api.py\n{shown}")


def test_check_flag_reports_up_to_date(capsys: pytest.CaptureFixture[str]) -> None:
    assert GEN.main(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_reference_covers_the_public_api() -> None:
    import fp8state
    import fp8state.checkpoint
    import fp8state.migrate

    shown = {entry.qualname for entry in GEN.entries()}
    for module in (fp8state, fp8state.checkpoint, fp8state.migrate, fp8state.errors):
        for name in module.__all__:
            if inspect.ismodule(getattr(module, name)):
                continue
            assert f"{module.__name__}.{name}" in shown
    assert "fp8state.functional.fp8_linear" in shown
    if hasattr(fp8state, "recalibrate"):
        assert "fp8state.recalibrate" in shown


def _has_example(obj: Any) -> bool:
    return ">>>" in (inspect.getdoc(obj) or "")


def test_public_functions_and_classes_have_examples() -> None:
    lacking = {
        entry.qualname
        for entry in GEN.entries()
        if (inspect.isclass(entry.obj) or inspect.isroutine(entry.obj))
        and not _has_example(entry.obj)
    }
    assert lacking - NO_EXAMPLE.keys() == set(), "add an Example: section to these"
    assert NO_EXAMPLE.keys() - lacking == set(), "these have examples now: drop them here"


def _doctests(name: str, obj: Any) -> list[doctest.DocTest]:
    # A module's own docstring only; its members are entries of their own.
    finder = doctest.DocTestFinder(recurse=not inspect.ismodule(obj), exclude_empty=True)
    return [t for t in finder.find(obj, name, globs={}) if t.examples]


def test_reference_has_examples_to_run() -> None:
    total = sum(len(t.examples) for name, obj in OBJECTS.items() for t in _doctests(name, obj))
    assert total >= 200, total


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_docstring_examples_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    with warnings.catch_warnings():
        # DCP says it "assumes a single process" when examples call dcp.save(no_dist=True).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        for test in _doctests(name, OBJECTS[name]):
            runner.run(test, out=report.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, report.getvalue()
