"""The GPU machine's package set on any machine: an import blocker for ``bench/gpu_check.sh --dry-run``.

The machine a GPU is lent on has python, torch, triton, numpy, pytest and
hypothesis (and what they depend on), nothing else, and no pip. A CPU
machine that rehearses the check has far more (vLLM, xxhash, matplotlib,
pytest plugins), so an import the GPU machine lacks would pass the
rehearsal and fail the one GPU run. :func:`install` makes every module
outside that set unfindable, exactly as it is there: ``import`` raises
``ModuleNotFoundError`` and ``importlib.util.find_spec`` answers None.

Allowed top-level modules: the standard library (its listed modules, and
anything found in its folders outside ``site-packages``, such as
``_sysconfigdata_*``), the repository's own code (any module found under the
repository root, outside a ``site-packages`` folder), and every module of :data:`GPU_MACHINE_PACKAGES` and of the
packages they require, transitively, as their installed metadata says
(requirements that apply only to an extra are left out; environment markers
are evaluated where ``packaging`` is installed, else kept). Installed
metadata is filtered the same way: ``importlib.metadata`` finds only the
distributions of that closure, as pip would have installed them there.
``bench/gpu_machine/sitecustomize.py`` installs it in every Python process
that has that folder on ``PYTHONPATH``, which the dry run sets.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed.importlib import MetaPathFinderProtocol

GPU_MACHINE_PACKAGES = ("torch", "triton", "numpy", "pytest", "hypothesis")
"""The distributions the GPU machine has, besides the standard library (their dependencies come with them)."""

ROOT = Path(__file__).resolve().parent.parent
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _applies(requirement: str) -> bool:
    """Whether a ``Requires-Dist`` line applies to a plain install here (not only to an extra)."""
    if ";" not in requirement:
        return True
    marker = requirement.split(";", 1)[1]
    if "extra" in marker:
        return False
    try:
        from packaging.markers import Marker
    except ImportError:  # keep it: allowing too much only makes the emulation laxer, never wrong
        return True
    return Marker(marker).evaluate()


def dependency_closure(roots: Iterable[str]) -> set[str]:
    """The normalised names of ``roots`` and of every installed distribution they require, transitively."""
    seen: set[str] = set()
    pending = [_normalized(root) for root in roots]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: nothing of it can be imported anyway
        seen.add(name)
        for requirement in requires:
            match = _NAME.match(requirement)
            if match and _applies(requirement):
                pending.append(_normalized(match.group(1)))
    return seen


def allowed_top_level_names(roots: Sequence[str] = GPU_MACHINE_PACKAGES) -> frozenset[str]:
    """Top-level module names the GPU machine has: the standard library and the closure of ``roots``."""
    closure = dependency_closure(roots)
    names = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
    for module, distributions in importlib.metadata.packages_distributions().items():
        if any(_normalized(distribution) in closure for distribution in distributions):
            names.add(module)
    return frozenset(names)


def _found_in(spec: importlib.machinery.ModuleSpec, folders: Sequence[Path]) -> bool:
    """Whether ``spec`` lies in one of ``folders`` and not in a ``site-packages`` (an installed package)."""
    locations = [spec.origin] if spec.origin else []
    locations += list(spec.submodule_search_locations or [])
    for location in locations:
        path = Path(location).resolve()
        if "site-packages" not in path.parts and any(path.is_relative_to(folder) for folder in folders):
            return True
    return False


@dataclass(eq=False)  # compared and hashed by identity, as a plain finder
class _Blocking(importlib.abc.MetaPathFinder):
    """Wraps one finder of ``sys.meta_path``: top-level modules and distributions outside the allowed sets are
    not found."""

    finder: MetaPathFinderProtocol
    allowed: frozenset[str]
    distributions: frozenset[str]
    folders: Sequence[Path]
    blocked: set[str]
    """Where each refused top-level name is added."""

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterator[importlib.metadata.Distribution]:
        find = getattr(self.finder, "find_distributions", None)
        if find is None:
            return
        found: Iterable[importlib.metadata.Distribution] = find(
            context or importlib.metadata.DistributionFinder.Context()
        )
        for distribution in found:
            if _normalized(distribution.metadata["Name"] or "") in self.distributions:
                yield distribution

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        spec = self.finder.find_spec(fullname, path, target)
        if spec is None or "." in fullname or fullname in self.allowed or _found_in(spec, self.folders):
            return spec
        self.blocked.add(fullname)
        return None

    def invalidate_caches(self) -> None:
        invalidate = getattr(self.finder, "invalidate_caches", None)
        if invalidate is not None:
            invalidate()


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return any(isinstance(finder, _Blocking) for finder in sys.meta_path)


BLOCKED: set[str] = set()
"""The top-level modules refused so far in this process (for messages and tests)."""


def install(roots: Sequence[str] = GPU_MACHINE_PACKAGES) -> frozenset[str]:
    """Hide every module the GPU machine lacks from this process's imports; the allowed top-level names.

    Modules imported before the call stay imported. Idempotent.
    """
    allowed = allowed_top_level_names(roots)
    distributions = frozenset(dependency_closure(roots))
    paths = sysconfig.get_paths()
    folders = [ROOT, *(Path(paths[key]).resolve() for key in ("stdlib", "platstdlib"))]
    # Built-in and frozen modules are the standard library's: wrapped like any finder, they pass as allowed.
    sys.meta_path[:] = [
        finder if isinstance(finder, _Blocking) else _Blocking(finder, allowed, distributions, folders, BLOCKED)
        for finder in sys.meta_path
    ]
    return allowed
