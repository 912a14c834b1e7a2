"""The docs hold together: the index lists every page, and no relative link points nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_the_index_lists_every_page_once() -> None:
    index = (DOCS / "index.md").read_text()
    linked = [target.partition("#")[0] for target in LINK.findall(index)]
    for page in _pages():
        if page.name != "index.md":
            assert linked.count(page.name) >= 1, f"docs/index.md does not list {page.name}"
    for group in ("Start", "Guides", "Operations", "Reference", "Design"):
        assert f"\n## {group}\n" in index


def test_the_readme_links_the_index() -> None:
    assert "(docs/index.md)" in (ROOT / "README.md").read_text()


def test_the_readme_is_short_and_starts_with_the_quickstart() -> None:
    # The README is a front door: what it is, then the quickstart; the rest is in docs/.
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, len(readme.splitlines())
    sections = re.findall(r"^## (.+)$", readme, flags=re.MULTILINE)
    assert sections[0] == "Quickstart", sections


def test_relative_links_reach_a_file() -> None:
    broken = []
    for source in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *_pages()]:
        for target in LINK.findall(source.read_text()):
            path = target.partition("#")[0]
            if not path or re.match(r"[a-z]+:", path):
                continue  # an anchor on the same page, or a URL
            if not (source.parent / path).exists():
                broken.append(f"{source.relative_to(ROOT)} -> {target}")
    assert not broken, "\n".join(broken)
