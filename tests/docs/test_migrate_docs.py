"""docs/migration.md's python example runs as written."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers.docs import python_blocks, run_blocks
from _helpers.paths import DOCS

DOC = DOCS / "migration.md"


@pytest.mark.filterwarnings("ignore:.*amax history has:UserWarning")
def test_migration_doc_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks(DOC)
    assert blocks
    monkeypatch.chdir(tmp_path)
    run_blocks(blocks, "docs_migration", "migration.md")
    assert (tmp_path / "te_linear.pt").exists()
