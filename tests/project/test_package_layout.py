"""The package is laid out in rooms that depend on each other one way only, each entered through its package.

The core (the keys and offload types, ``manager``, ``worker``, ``kernels``) is
what a server runs and knows nothing of vLLM or the command line;
``integrations`` plugs the core into vLLM and Mooncake; ``sim`` is the
simulator, built on the core; ``cli`` is the command line, built on all of
them. So a server process never imports the command line or the simulator,
and the manager never imports the worker.

A package's private modules are its own, at any depth: another room imports
``kvtriton.worker``, never ``kvtriton.worker._engine``, and inside
``integrations`` ``remote/`` imports ``kvtriton.integrations.vllm``, never its
``_surface``; so each package's ``__all__`` is the whole of what leaves it. A
package's own modules, its sub-packages' included, may import its private
modules: the top-level ``kvtriton/_*.py`` modules are the shared core every
room may import. ``bench/`` is outside every package: it imports the public
lists, and the private names ``bench/_internals.py`` gives a reason for, no
others. No module imports itself back through others (the cycle check below
is a plain walk of the import statements).
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

import pytest

from bench._internals import PRIVATE_NAMES

PACKAGE = Path(__file__).resolve().parents[2] / "kvtriton"
# Each room and the rooms it must never import.
FORBIDDEN = {
    "manager": ("kvtriton.worker", "kvtriton.integrations", "kvtriton.sim", "kvtriton.cli"),
    "worker": ("kvtriton.integrations", "kvtriton.sim", "kvtriton.cli"),
    "kernels": ("kvtriton.manager", "kvtriton.worker", "kvtriton.integrations", "kvtriton.sim", "kvtriton.cli"),
    "integrations": ("kvtriton.sim", "kvtriton.cli"),
    "sim": ("kvtriton.integrations", "kvtriton.cli"),
    # The cipher and its keys serve the tiers: they know nothing of who seals what.
    "encryption": ("kvtriton.manager", "kvtriton.worker", "kvtriton.integrations", "kvtriton.sim", "kvtriton.cli"),
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


def _module_name(source: Path) -> str:
    parts = source.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_sources() -> dict[str, Path]:
    """Every module of the package by name; kvtriton/kernels is a symlink to kernels/, which rglob does not follow:
    it is walked as kvtriton.kernels."""
    files = [source for source in PACKAGE.rglob("*.py") if "__pycache__" not in source.parts]
    kernels = PACKAGE.parent / "kernels"
    files += [PACKAGE / "kernels" / source.relative_to(kernels) for source in kernels.rglob("*.py")]
    return {_module_name(source): source for source in files}


def _every_import(source: Path, importer: str) -> list[tuple[int, str]]:
    """Every ``kvtriton`` name a file imports, anywhere in it (function bodies and TYPE_CHECKING blocks included),
    as a dotted path: ``from a._b import c`` is ``a._b.c``, a relative import is resolved against ``importer`` (the
    file's module name; a package's is its own), and ``importlib.import_module("a._b")`` with a literal is ``a._b``.
    """
    package = importer if source.name == "__init__.py" else importer.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"), filename=str(source))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = node.module if node.level == 0 else ".".join(filter(None, [base, node.module]))
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names if module)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return [(line, name) for line, name in found if name.split(".")[0] == "kvtriton"]


def _owner(name: str) -> str | None:
    """The package whose private module (or name) the dotted ``name`` reaches into: the part before its first
    private part (``kvtriton.integrations.vllm._surface.OffloadKey`` -> ``kvtriton.integrations.vllm``); None when
    it reaches nothing private (dunders such as ``__version__`` are public)."""
    parts = name.split(".")
    for index, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not part.endswith("__"):
            return ".".join(parts[:index])
    return None


def _private_reaches(importer: str, source: Path) -> list[tuple[int, str]]:
    """The imports in ``source`` (module ``importer``) of a private module or name of a package it is not inside."""
    return [
        (line, name)
        for line, name in _every_import(source, importer)
        if (owner := _owner(name)) is not None and not importer.startswith(f"{owner}.") and importer != owner
    ]


BENCH = PACKAGE.parent / "bench"


def _reaches_outside_the_rule() -> dict[str, list[tuple[int, str]]]:
    """Per file (its path from the repository root): each import of a private kvtriton module or name from outside
    its package, less the private names bench/_internals.py lists for the benchmarks."""
    sources = list(_package_sources().items())
    sources += [
        (f"bench.{source.relative_to(BENCH).with_suffix('').as_posix().replace('/', '.')}", source)
        for source in sorted(BENCH.rglob("*.py"))
    ]
    found: dict[str, list[tuple[int, str]]] = {}
    for module, source in sources:
        allowed = PRIVATE_NAMES if module.startswith("bench.") else {}
        reaches = [(line, name) for line, name in _private_reaches(module, source) if name not in allowed]
        if reaches:
            found[source.relative_to(PACKAGE.parent).as_posix()] = reaches
    return found


def test_a_private_module_is_imported_only_from_inside_its_package() -> None:
    # At any depth: kvtriton.integrations.remote enters kvtriton.integrations.vllm by its package, never its
    # _surface, while every module under kvtriton.integrations may import kvtriton.integrations._vllm_release and
    # every module of kvtriton the top-level kvtriton/_*.py (the shared core). bench/ is outside every package:
    # it imports the public lists, and the private names bench/_internals.py gives a reason for.
    offenders = [
        f"{path}:{line} imports {name}"
        for path, reaches in sorted(_reaches_outside_the_rule().items())
        for line, name in reaches
    ]
    assert not offenders, (
        "import the package (and export the name in its __all__) instead, or for a benchmark that needs a private "
        "name, list it with why in bench/_internals.py:\n" + "\n".join(offenders)
    )


def test_every_private_name_the_benchmarks_may_import_is_imported_and_explained() -> None:
    imported = {name for source in BENCH.rglob("*.py") for _, name in _every_import(source, "bench")}
    assert sorted(set(PRIVATE_NAMES) - imported) == [], "no benchmark imports these: drop them from bench/_internals.py"
    assert [name for name, why in PRIVATE_NAMES.items() if not why.strip()] == []
    assert all(_owner(name) is not None for name in PRIVATE_NAMES), "a public name needs no reason"


def test_the_private_reach_check_finds_one(tmp_path: Path) -> None:
    source = tmp_path / "_tier.py"
    source.write_text(
        "from kvtriton._integrity import SEAL_BYTES\n"  # the shared core: inside kvtriton
        "from kvtriton.integrations._vllm_release import VLLM_INSTALL\n"  # its parent package's: inside
        "from kvtriton.integrations.remote._client import RemoteClient\n"  # its own package's
        "from ._seals import SealedSlots\n"  # the same, relative
        "from kvtriton import __version__\n"  # a dunder is public
        "from kvtriton.integrations.vllm import OffloadKey\n"  # a sibling package, through its door
        "from kvtriton.integrations.vllm._surface import OffloadKey\n"  # a sibling's private module
        "from ..vllm._identity import KVIdentity\n"  # the same, relative
        "from kvtriton.worker import _engine\n"  # another room's private module, named as an attribute
        "def load():\n"
        "    import kvtriton.kernels._jit.copy_pages\n"
        "    importlib.import_module('kvtriton.worker._slab')\n",
        encoding="utf-8",
    )
    assert _private_reaches("kvtriton.integrations.remote._tier", source) == [
        (7, "kvtriton.integrations.vllm._surface.OffloadKey"),
        (8, "kvtriton.integrations.vllm._identity.KVIdentity"),
        (9, "kvtriton.worker._engine"),
        (11, "kvtriton.kernels._jit.copy_pages"),
        (12, "kvtriton.worker._slab"),
    ]


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
    sources = _package_sources()
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
