"""Every relative link in README.md and docs/*.md names a file or folder of the repository (anchors aside)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) or [text](target "title"); images too. Code spans are dropped first: they may hold brackets.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)
EXTERNAL = ("http://", "https://", "mailto:")


def _targets(page: Path) -> list[str]:
    text = CODE.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not t.startswith(EXTERNAL) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    missing = [t for t in _targets(page) if not (page.parent / t.split("#", 1)[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_the_pages_have_links_to_check() -> None:
    assert _targets(ROOT / "README.md"), "no relative link found in README.md: is the pattern still right?"
