"""The docs stay short, linked and free of history.

README.md is the five-minute page (at most README_MAX_LINES lines); every relative link in
README.md and docs/**/*.md names a file that exists (and, into a Markdown page, a heading
that exists); README.md, docs/ and CHANGELOG.md carry no commit hashes, no "QA pass" notes
and no issue numbers: history lives in CHANGELOG.md's sections and in commit bodies.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 260

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the target ends at whitespace or ")" (a title may follow).
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s+<?(\S+?)>?(?:\s+.*)?$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...
# A hex run of 7-40 digits holding a digit and a letter: an abbreviated or full commit hash.
COMMIT_HASH = re.compile(
    r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
QA_PASS = re.compile(r"\bQA pass\b", re.I)
ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d+|(?<![\w&/])#\d+\b", re.I)


def markdown_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def history_free_files(root: Path = ROOT) -> list[Path]:
    """The files that must not carry history: README.md, docs/ (its generated charts
    aside) and CHANGELOG.md."""
    docs = [p for p in sorted((root / "docs").rglob("*"))
            if p.is_file() and "charts" not in p.relative_to(root / "docs").parts]
    return [root / "README.md", root / "CHANGELOG.md", *docs]


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page (repeated headings get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that name no file (or no heading of a page)."""
    text = prose(page.read_text(encoding="utf-8"))
    targets = LINK.findall(text) + REFERENCE.findall(text)
    broken = []
    for target in targets:
        if EXTERNAL.match(target):
            continue
        path_part, _, fragment = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {resolved.name}")
    return broken


def history_marks(path: Path) -> list[str]:
    """Commit hashes, "QA pass" notes and issue numbers in ``path``."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for pattern in (COMMIT_HASH, QA_PASS, ISSUE_NUMBER):
            found += [f"line {number}: {m.group(0)!r}" for m in pattern.finditer(line)]
    return found


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move detail into docs/")


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == [], f"{page.relative_to(ROOT)}: broken links"


@pytest.mark.parametrize("path", history_free_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_history_marks(path: Path) -> None:
    assert path.exists(), f"{path.relative_to(ROOT)} is missing"
    assert history_marks(path) == [], (
        f"{path.relative_to(ROOT)}: history belongs in commit bodies, not here")


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[ok](page.md#top) [gone](nope.md) [bad](page.md#nope) "
                    "[web](https://example.com)\n\n```\n[in code](missing.md)\n```\n"
                    "Landed in 1921d31 (QA pass 3), see issue #19.\n", encoding="utf-8")
    assert broken_links(page) == ["nope.md: no such file",
                                  "page.md#nope: no heading #nope in page.md"]
    marks = history_marks(page)
    assert len(marks) == 3 and "'1921d31'" in marks[0]
    clean = tmp_path / "clean.md"
    clean.write_text("1048576 bytes, 4e-6, a defaced sha256 and `#include` stay.\n",
                     encoding="utf-8")
    assert history_marks(clean) == []
