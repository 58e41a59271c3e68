"""The python blocks of a Markdown page, and running them as written (one namespace, in order)."""

from __future__ import annotations

import re
from pathlib import Path

#: The pages whose python blocks docs/test_docs_examples.py runs (docs/test_docs_links.py checks
#: that every page with python blocks is run by some test).
DOCS_WITH_CODE = [
    "README.md",
    "docs/export.md",
    "docs/custom_modules.md",
    "docs/concepts_scaling.md",
    "docs/schema.md",
    "docs/getting_started.md",
    "docs/concepts.md",
    "docs/checkpoints.md",
    "docs/faq.md",
    "docs/activation_checkpointing.md",
    "docs/lightning.md",
    "docs/huggingface.md",
    "docs/graphs.md",
    "docs/compile.md",
    "docs/fp8_compute.md",
]

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(path: Path) -> list[str]:
    """The code of every python block of ``path``, in order."""
    return _BLOCK.findall(path.read_text())


def run_blocks(blocks: list[str], module_name: str, label: str) -> dict[str, object]:
    """Execute ``blocks`` in order in one namespace named ``module_name``; return the namespace.

    A traceback names the block as ``{label}[block {i}]``.
    """
    namespace: dict[str, object] = {"__name__": module_name}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{label}[block {i}]", "exec"), namespace)  # noqa: S102
    return namespace
