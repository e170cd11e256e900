"""The Mooncake install is stated once (docs/mooncake.md#install), as the Makefile installs it; no page has another."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kvtriton.integrations._mooncake_local import (
    MINIMUM_MOONCAKE_VERSION,
    MOONCAKE_PACKAGES,
    mooncake_missing,
    mooncake_version_problem,
)

REPO = Path(__file__).resolve().parents[3]


def makefile_value(name: str) -> str:
    match = re.search(rf"^{name} := (.+)$", (REPO / "Makefile").read_text(encoding="utf-8"), re.MULTILINE)
    assert match, f"the Makefile has no {name}"
    return match.group(1).strip()


def test_the_package_line_is_the_makefiles() -> None:
    assert MOONCAKE_PACKAGES == makefile_value("MOONCAKE_PACKAGES")


def test_docs_mooncake_gives_the_makefiles_packages_and_os_libraries() -> None:
    page = (REPO / "docs" / "mooncake.md").read_text(encoding="utf-8")
    assert f"pip install --no-deps {MOONCAKE_PACKAGES}\n" in page
    libraries = [pair.split(":")[1] for pair in makefile_value("MOONCAKE_SYSTEM_LIBS").split()]
    assert f"apt-get install -y {' '.join(libraries)}" in page


def test_no_other_page_gives_its_own_mooncake_install_line() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    others = [
        f"{page.relative_to(REPO)}:{number}"
        for page in pages
        if page.name != "mooncake.md"
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"mooncake-transfer-engine|kvtriton\[[^\]]*mooncake|libibverbs", line)
    ]
    assert others == [], "these pages state a Mooncake install of their own; point them at docs/mooncake.md#install"


def test_the_missing_package_message_gives_the_same_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(name: str) -> None:
        del name

    monkeypatch.setattr(importlib.util, "find_spec", absent)  # as on a machine without mooncake
    message = mooncake_missing()
    assert message is not None and f"pip install --no-deps {MOONCAKE_PACKAGES} (" in message


@pytest.mark.parametrize(
    ("version", "refused"),
    [("0.3.12", True), ("0.3.11.post1", True), ("0.2.9", True), ("dev", True), ("0.3.13", False),
     ("0.3.13.post1", False), ("0.3.14rc1", False), ("0.4.0", False)],
)  # fmt: skip  # a table: the versions refused and taken, in rows
def test_a_mooncake_older_than_the_minimum_is_refused_naming_the_advisory_and_the_install_line(
    version: str, refused: bool
) -> None:
    problem = mooncake_version_problem((version, "mooncake-transfer-engine"))
    assert (problem is not None) == refused
    if problem is not None:
        assert problem.startswith(
            f"mooncake-transfer-engine {version} is installed, but the Mooncake tier needs 0.3.13"
        )
        assert "CVE-2026-103764" in problem and f"pip install --no-deps {MOONCAKE_PACKAGES}" in problem
    assert ".".join(map(str, MINIMUM_MOONCAKE_VERSION)) == "0.3.13"


def test_the_pinned_release_meets_the_minimum() -> None:
    pinned = re.search(r"==(\S+)", MOONCAKE_PACKAGES)
    assert pinned is not None
    assert mooncake_version_problem((pinned.group(1), "mooncake-transfer-engine-non-cuda")) is None
    assert mooncake_version_problem() is None  # what this environment has installed (or nothing)


def test_the_security_page_states_the_minimum_the_tier_enforces_and_is_linked() -> None:
    page = (REPO / "docs" / "security.md").read_text(encoding="utf-8")
    minimum = ".".join(map(str, MINIMUM_MOONCAKE_VERSION))
    assert f"**The oldest Mooncake kvtriton accepts is {minimum}.**" in page
    assert "| CVE-2026-103764 |" in page  # the advisory the minimum answers
    for linking in ("index.md", "operations.md"):
        assert "](security.md" in (REPO / "docs" / linking).read_text(encoding="utf-8"), linking
