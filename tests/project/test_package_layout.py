"""The package is laid out in rooms that depend on each other one way only.

The core (the keys and offload types, ``manager``, ``worker``, ``kernels``) is
what a server runs and knows nothing of vLLM or the command line;
``integrations`` plugs the core into vLLM and Mooncake; ``sim`` is the
simulator, built on the core; ``cli`` is the command line, built on all of
them. So a server process never imports the command line or the simulator,
and the manager never imports the worker.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvtriton"
# Each room and the rooms it must never import.
FORBIDDEN = {
    "manager": ("kvtriton.worker", "kvtriton.integrations", "kvtriton.sim", "kvtriton.cli"),
    "worker": ("kvtriton.integrations", "kvtriton.sim", "kvtriton.cli"),
    "kernels": ("kvtriton.manager", "kvtriton.worker", "kvtriton.integrations", "kvtriton.sim", "kvtriton.cli"),
    "integrations": ("kvtriton.sim", "kvtriton.cli"),
    "sim": ("kvtriton.integrations", "kvtriton.cli"),
}


def _imported_modules(source: Path) -> set[str]:
    tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            modules.add(node.module)
    return modules


def _sources(room: str) -> list[Path]:
    if room == "core":
        return sorted(source for source in PACKAGE.glob("_*.py") if source.name != "__init__.py")
    return sorted((PACKAGE / room).rglob("*.py"))


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_a_room_never_imports_the_rooms_built_on_it(room: str) -> None:
    sources = _sources(room)
    assert sources, f"kvtriton/{room} holds no Python files"
    offenders = {
        str(source.relative_to(PACKAGE)): sorted(m for m in _imported_modules(source) if m.startswith(FORBIDDEN[room]))
        for source in sources
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}


def test_the_core_modules_import_only_the_core() -> None:
    # the package's __init__ names the worker's classes too (imported on first use)
    outside = ("kvtriton.worker", "kvtriton.integrations", "kvtriton.sim", "kvtriton.cli")
    offenders = {
        source.name: sorted(m for m in _imported_modules(source) if m.startswith(outside))
        for source in _sources("core")
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}
