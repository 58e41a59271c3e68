"""docs/migration.md's python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "migration.md"


@pytest.mark.filterwarnings("ignore:.*amax history has:UserWarning")
def test_migration_doc_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL)
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs_migration"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"migration.md[block {i}]", "exec"), namespace)  # noqa: S102
    assert (tmp_path / "te_linear.pt").exists()
