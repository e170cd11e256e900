"""The package is laid out by side, and the sides depend on each other one way only.

The worker (``kvtriton/worker``, ``kvtriton/kernels``) and the manager
(``kvtriton/manager``) are what a server runs; the operator tools
(``kvtriton/tools``) are built on them and never the other way round, so a
server process never imports the command line, the demo or the simulator.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvtriton"
SERVING_SIDES = ("worker", "manager", "kernels", "integrations", "tiers")


def _imported_modules(source: Path) -> set[str]:
    tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("side", SERVING_SIDES)
def test_serving_code_never_imports_the_operator_tools(side: str) -> None:
    sources = sorted((PACKAGE / side).rglob("*.py"))
    assert sources, f"kvtriton/{side} holds no Python files"
    offenders = {
        str(source.relative_to(PACKAGE)): sorted(m for m in _imported_modules(source) if m.startswith("kvtriton.tools"))
        for source in sources
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}


def test_manager_never_imports_the_worker() -> None:
    offenders = {
        str(source.relative_to(PACKAGE)): sorted(
            m for m in _imported_modules(source) if m.startswith("kvtriton.worker")
        )
        for source in sorted((PACKAGE / "manager").rglob("*.py"))
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}
