"""The docs hold together: docs/index.md lists every page, relative links and their anchors
resolve, and every page with python blocks is executed by a test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _helpers.docs import DOCS_WITH_CODE
from _helpers.paths import DOCS, REPO_ROOT

PAGES = sorted([REPO_ROOT / "README.md", *DOCS.glob("*.md")])
#: Pages whose python blocks another test file runs (it names the page).
RUN_ELSEWHERE = {
    "docs/migration.md": "tests/docs/test_migrate_docs.py",
    "docs/interop.md": "tests/docs/test_plain_interop_docs.py",
}
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)


def _prose(path: Path) -> str:
    return _FENCE.sub("", path.read_text())


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -."""
    return {
        re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        for title in _HEADING.findall(_prose(path))
    }


def _rel(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def test_index_lists_every_page() -> None:
    linked = {target.split("#")[0] for target in _LINK.findall(_prose(DOCS / "index.md"))}
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert pages - linked == set(), "add these pages to docs/index.md"
    results = {f"results/{p.name}" for p in (DOCS / "results").glob("*")}
    assert results - linked == set(), "add these records to docs/index.md"


def test_readme_points_at_the_index() -> None:
    assert "](docs/index.md)" in (REPO_ROOT / "README.md").read_text()


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert broken == []


def test_every_page_with_python_blocks_is_run() -> None:
    for page in PAGES:
        name = _rel(page)
        if "```python" not in page.read_text():
            continue
        if name in DOCS_WITH_CODE:
            continue
        runner = RUN_ELSEWHERE.get(name)
        assert runner is not None, f"{name} has python blocks: add it to DOCS_WITH_CODE"
        assert Path(name).name in (REPO_ROOT / runner).read_text()
