"""The README's and the docs' relative links reach a file and, with ``#``, a heading in it
(anchors as GitHub makes them from headings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """GitHub's slug: lower case, punctuation dropped (hyphens and underscores kept),
    spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading and not in_code:
            slug = github_anchor(heading.group(1))
            repeat = counts.get(slug, 0)
            counts[slug] = repeat + 1
            found.add(slug if repeat == 0 else f"{slug}-{repeat}")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_heading(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part) if file_part else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == [], f"{doc.relative_to(ROOT)}: {broken}"
