"""Where benchmark scripts put their results: printed, and merged into a JSON file."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["report"]


def report(result: dict, out: Path | None) -> None:
    """Print ``result`` as JSON; with ``out``, merge its keys into that file (others stay)."""
    print(json.dumps(result, indent=2))
    if out is not None:
        recorded = json.loads(out.read_text()) if out.exists() else {}
        recorded.update(result)
        out.write_text(json.dumps(recorded, indent=2) + "\n")
