"""README and docs/ point only at files inside the repository, and every link resolves.

A clone is all a reader has: a link to a file that was renamed, or a path
that leaves the repository (``../shared/...``), is a dead end. Links are
checked as Markdown renders them (inline links, images, reference
definitions; not inside code blocks); relative paths written in the text
(``../something``) must name something inside the repository too; a ``#fragment``
into a Markdown file must name one of its headings.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
_PARENT_PATH = re.compile(r"(?<![\w./-])((?:\.\./)+[\w./-]*)")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:


@dataclass(frozen=True, slots=True)
class Link:
    source: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.source.relative_to(REPO)}:{self.line}: {self.target}"


def _without_code_blocks(text: str) -> str:
    """``text`` with fenced code blocks blanked out, newlines kept so line numbers stay right."""
    return _FENCE.sub(lambda match: "\n" * match.group(0).count("\n"), text)


def links_in(source: Path) -> list[Link]:
    """Every link target of a Markdown file, as written, with its line."""
    text = _without_code_blocks(source.read_text(encoding="utf-8"))
    found: list[Link] = []
    for pattern in (_INLINE_LINK, _REFERENCE_DEFINITION):
        for match in pattern.finditer(text):
            found.append(Link(source, text.count("\n", 0, match.start(1)) + 1, match.group(1)))
    return sorted(found, key=lambda link: (link.line, link.target))


def heading_anchors(markdown: Path) -> set[str]:
    """The ``#fragment`` each heading of ``markdown`` gets, as GitHub renders it."""
    anchors: set[str] = set()
    text = _without_code_blocks(markdown.read_text(encoding="utf-8"))
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def link_problem(link: Link) -> str | None:
    """Why ``link`` is a dead end for a reader of a clone, or ``None`` when it resolves."""
    if _EXTERNAL.match(link.target):
        return None
    path_part, _, fragment = link.target.partition("#")
    path_part = path_part.split("?", 1)[0]
    if path_part.startswith("/"):
        return "an absolute path: link relative to the file instead"
    target = (link.source.parent / path_part).resolve() if path_part else link.source
    if not target.is_relative_to(REPO):
        return "leaves the repository"
    if not target.exists():
        return "no such file in the repository"
    if fragment and target.suffix == ".md" and fragment not in heading_anchors(target):
        return f"{target.relative_to(REPO)} has no heading #{fragment}"
    return None


def test_the_docs_are_found() -> None:
    assert REPO / "README.md" in DOCS and REPO / "docs" / "design.md" in DOCS and len(DOCS) > 3


@pytest.mark.parametrize("source", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_link_resolves_inside_the_repository(source: Path) -> None:
    problems = [f"{link}: {why}" for link in links_in(source) if (why := link_problem(link)) is not None]
    assert problems == []


def dead_parent_paths(source: Path) -> list[str]:
    """``../`` paths written anywhere in ``source`` (code spans and blocks too) that leave the repository
    or name nothing in it."""
    text = source.read_text(encoding="utf-8")
    dead: list[str] = []
    for match in _PARENT_PATH.finditer(text):
        target = (source.parent / match.group(1)).resolve()
        if not (target.is_relative_to(REPO) and target.exists()):
            dead.append(f"{source.relative_to(REPO)}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(1)}")
    return dead


@pytest.mark.parametrize("source", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_no_path_in_the_text_leaves_the_repository(source: Path) -> None:
    assert dead_parent_paths(source) == []


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def scratch_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty repository of its own, so each checker is shown to fail on each defect."""
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    return tmp_path


def test_the_link_checker_catches_dead_links_escapes_and_bad_fragments(scratch_repo: Path) -> None:
    _write(scratch_repo / "docs", "guide.md", "# The guide\n\n## Two `words`\n")
    page = _write(
        scratch_repo / "docs",
        "page.md",
        "See [guide](guide.md), [a part](guide.md#two-words), [web](https://example.com) and [top](#title).\n"
        "# Title\n"
        "Broken: [gone](missing.md), [out](../../shared/docs/API.md), [abs](/etc/passwd),"
        " [part](guide.md#no-such-heading).\n"
        "```\n[in a code block](not-checked.md)\n```\n"
        "[ref]: ./also-missing.md\n",
    )
    problems = {link.target: link_problem(link) for link in links_in(page)}
    assert problems == {
        "guide.md": None,
        "guide.md#two-words": None,
        "https://example.com": None,
        "#title": None,
        "missing.md": "no such file in the repository",
        "../../shared/docs/API.md": "leaves the repository",
        "/etc/passwd": "an absolute path: link relative to the file instead",
        "guide.md#no-such-heading": "docs/guide.md has no heading #no-such-heading",
        "./also-missing.md": "no such file in the repository",
    }
    assert [link.line for link in links_in(page) if link.target == "missing.md"] == [3]


def test_a_parent_path_in_the_text_that_leads_nowhere_is_caught(scratch_repo: Path) -> None:
    (scratch_repo / "kernels").mkdir()
    page = _write(
        scratch_repo / "docs",
        "page.md",
        "The kernels are in `../kernels/`.\nThe design documents are in `../shared/docs/`.\n"
        "```sh\ncat ../../elsewhere/notes.txt\n```\n",
    )
    # ../kernels/ exists in the repository; ../shared/docs/ does not; ../../elsewhere leaves it.
    assert dead_parent_paths(page) == [
        "docs/page.md:2: ../shared/docs/",
        "docs/page.md:4: ../../elsewhere/notes.txt",
    ]
