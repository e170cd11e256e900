"""The package is laid out in rooms that depend on each other one way only, each entered through its package.

The core (the keys and offload types, ``manager``, ``worker``, ``kernels``) is
what a server runs and knows nothing of vLLM or the command line;
``integrations`` plugs the core into vLLM and Mooncake; ``sim`` is the
simulator, built on the core; ``cli`` is the command line, built on all of
them. So a server process never imports the command line or the simulator,
and the manager never imports the worker.

A room's private modules are its own: another room imports ``kvtriton.worker``,
never ``kvtriton.worker._engine``, so each package's ``__all__`` is the whole of
what leaves it. The top-level ``kvtriton/_*.py`` modules are the shared core
every room may import. No module imports itself back through others (the
cycle check below is a plain walk of the import statements).
"""

from __future__ import annotations

import ast
from collections.abc import Collection
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


ROOMS = ("manager", "worker", "kernels", "integrations", "sim", "cli")


def _room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "kvtriton" and parts[1] in ROOMS else None


def _every_import(source: Path) -> list[tuple[int, str]]:
    """Every ``kvtriton`` module a file imports, anywhere in it (function bodies and TYPE_CHECKING blocks included)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"), filename=str(source))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_enters_another_only_through_its_package(room: str) -> None:
    offenders: list[str] = []
    for source in _sources(room):
        for line, module in _every_import(source):
            other = _room_of(module)
            private = [part for part in module.split(".")[2:] if part.startswith("_")]
            if other is not None and other != room and private:
                offenders.append(f"{source.relative_to(PACKAGE)}:{line} imports {module}")
    assert offenders == [], "import the room's package (and export the name there) instead"


def _module_name(source: Path) -> str:
    parts = source.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _load_time_imports(source: Path, known: Collection[str]) -> set[str]:
    """The package modules ``source`` imports when it is loaded: its module-level imports, TYPE_CHECKING blocks out.

    ``from a.b import c`` counts as importing ``a.b.c`` when that is a module,
    else ``a.b``; what runs only inside a function is not a load-time edge.
    """
    imported: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    imported.add(submodule if submodule in known else node.module)
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(source.read_text(encoding="utf-8"), filename=str(source)).body)
    return {module for module in imported if module in known}


def _import_graph() -> dict[str, set[str]]:
    # kvtriton/kernels is a symlink to kernels/, which rglob does not follow: walk it as kvtriton.kernels.
    files = [source for source in PACKAGE.rglob("*.py") if "__pycache__" not in source.parts]
    kernels = PACKAGE.parent / "kernels"
    files += [PACKAGE / "kernels" / source.relative_to(kernels) for source in kernels.rglob("*.py")]
    sources = {_module_name(source): source for source in files}
    return {module: _load_time_imports(source, sources) - {module} for module, source in sources.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_imports_itself_back_at_load_time() -> None:
    graph = _import_graph()
    assert "kvtriton.worker._engine" in graph and "kvtriton.kernels._pages" in graph  # the walk sees the package
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
