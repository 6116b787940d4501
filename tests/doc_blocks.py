"""The documentation's fenced blocks, for the tests that run them or check them against real output.

A page is ``README.md`` or a page under ``docs/`` (``"docs/guide.md"``), relative to the repository root.
"""

from __future__ import annotations

import re
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def doc_text(page: str = "README.md") -> str:
    return (PROJECT / page).read_text()


def doc_block(page: str, lang: str, first_line: str) -> str:
    """The ``page``'s code block in ``lang`` whose first line starts with ``first_line``."""
    for block in re.findall(rf"```{lang}\n(.*?)```", doc_text(page), re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"{page} has no ```{lang} block starting with {first_line!r}")


def fenced_blocks(page: str = "README.md") -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced block of ``page``, in order (fences may be indented)."""
    blocks, current, lang = [], None, ""
    for line in doc_text(page).splitlines():
        fence = line.strip().startswith("```")
        if fence and current is None:
            current, lang = [], line.strip()[3:]
        elif fence:
            blocks.append((lang, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def shown_output(page: str, command: str) -> list[str]:
    """The lines ``page`` shows under ``$ <command>`` in an output block, up to the next ``$`` line."""
    for lang, lines in fenced_blocks(page):
        for i, line in enumerate(lines):
            if not lang and line.startswith(f"$ {command}"):
                rest = lines[i + 1:]
                end = next((j for j, x in enumerate(rest) if x.startswith("$ ")), len(rest))
                return rest[:end]
    raise AssertionError(f"{page} shows no output of {command!r}")


def prose(page: str) -> str:
    """``page``'s text with backticks dropped and runs of white space (line breaks too) made one space."""
    return " ".join(doc_text(page).replace("`", "").split())
