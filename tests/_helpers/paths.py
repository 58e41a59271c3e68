"""Where things are, from this file's place in the repository (``tests/_helpers/``)."""

from __future__ import annotations

from pathlib import Path

#: ``tests/``: on ``sys.path`` during a test run; subprocesses that import the helpers add it.
TESTS = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS.parent
DOCS = REPO_ROOT / "docs"
#: The vendored TransformerEngine checkpoints (tests/fixtures/README.md); tests read only these.
FIXTURES = TESTS / "fixtures"
#: The CUDA tests and the two-GPU proof's scripts.
GPU_DIR = TESTS / "gpu"
