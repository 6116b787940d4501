"""The documentation's shape: a short README that links every page under docs/, links that lead somewhere, and a
config reference that is the schema's (docs/config.md, generated)."""

from __future__ import annotations

import re
from pathlib import Path

from doc_blocks import PROJECT, doc_text

README_MAX_LINES = 300
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def pages() -> list[str]:
    return ["README.md", *sorted(str(p.relative_to(PROJECT)) for p in (PROJECT / "docs").glob("*.md"))]


def without_blocks(text: str) -> str:
    """``text`` less its fenced blocks (a '# comment' there is no heading)."""
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


def without_code(text: str) -> str:
    """``text`` less its fenced blocks and inline code spans, where a [x](y) is no link."""
    return re.sub(r"`[^`\n]*`", "", without_blocks(text))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings: lower case, punctuation other than '-' and '_'
    dropped, spaces made '-'; a repeated one gets -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    for line in without_blocks(path.read_text()).splitlines():
        heading = re.match(r"#{1,6} +(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = "".join(c for c in heading[1].replace("`", "").lower() if c.isalnum() or c in "-_ ").replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_readme_is_at_most_300_lines():
    """The README is what it is, the two commands, your own project, the recipe in brief and where to go next;
    the rest is under docs/."""
    lines = len(doc_text("README.md").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move text to docs/"


def test_every_relative_link_leads_to_a_file_and_its_anchor():
    """Every relative link (and image) of the README and of each page under docs/ names a file that exists, and a
    #anchor into a Markdown file names one of its headings."""
    broken = []
    for page in pages():
        base = (PROJECT / page).parent
        for target in LINK.findall(without_code(doc_text(page))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (base / path).resolve() if path else PROJECT / page
            if not file.exists():
                broken.append(f"{page}: {target} (no such file)")
            elif not file.is_relative_to(PROJECT):
                broken.append(f"{page}: {target} (outside the repository)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page}: {target} (no heading #{anchor} in {file.relative_to(PROJECT)})")
    assert broken == []


def test_readme_links_every_page_under_docs():
    """The README's "Where to go next" reaches every page."""
    section = doc_text("README.md").split("## Where to go next", 1)[1]
    linked = {target.partition("#")[0] for target in LINK.findall(section)}
    assert [page for page in pages()[1:] if page not in linked] == []

