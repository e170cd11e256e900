"""kvtriton: offload the paged KV cache of an LLM server to host memory.

The scheduler side (keys, specs, managers) imports neither torch nor triton;
the worker-side names (``PagedKV``, ``HostSlab``, ``TransferEngine``, ...) are
imported from :mod:`kvtriton.worker` on first use, so ``import kvtriton``
stays light in a scheduler process. ``__all__`` below is the public list that
docs/usage.md documents; each subpackage has its own.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING

from kvtriton._keys import OffloadKey, get_offload_block_hash, get_offload_group_idx, make_offload_key
from kvtriton._offload_types import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
)
from kvtriton._version import __version__ as __version__
from kvtriton.manager import (
    CPUOffloadingManager,
    FilterReusedOffloadingManager,
    ManagerStats,
    OffloadingManager,
)

if TYPE_CHECKING:
    from kvtriton.worker import (
        HostSlab,
        KVLayout,
        PageableSlabWarning,
        PagedKV,
        SlabPinningError,
        TransferBackend,
        TransferEngine,
        TransferLane,
        TransferResult,
    )

# Worker-side names (``kvtriton.worker``'s list, the part a server needs); they import torch.
_WORKER_NAMES = frozenset(
    {
        "HostSlab",
        "KVLayout",
        "PageableSlabWarning",
        "PagedKV",
        "SlabPinningError",
        "TransferBackend",
        "TransferEngine",
        "TransferLane",
        "TransferResult",
    }
)


_ENTRY_MODULES = (
    "kvtriton's spec_module_path for vLLM is 'kvtriton.integrations.vllm'; a tier's module_path is "
    "'kvtriton.integrations.mooncake' or 'kvtriton.integrations.remote'"
)


class _ModuleSuggestions:
    """The last finder on ``sys.meta_path``: a ``kvtriton.*`` module nothing else found is refused with a suggestion.

    vLLM imports ``spec_module_path`` (and a tier's ``module_path``) with
    ``importlib.import_module``: a typo such as ``kvtriton.integration.vllm``
    would fail with a bare ``No module named 'kvtriton.integration'``. The
    import system asks this finder only after every finder before it found
    nothing, so an import that succeeds never reaches it, and before refusing
    it asks the finders placed after it, so it never hides a module one of
    them serves. Only public names under ``kvtriton.`` are answered (what a
    configuration names); for every other missing module, private ones
    included, it returns None at once, and Python's own error stands.
    The one difference: ``importlib.util.find_spec`` of a missing
    ``kvtriton.*`` module raises this ``ModuleNotFoundError`` instead of
    returning None, as it already does for any dotted name whose parent is missing.
    """

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if not fullname.startswith("kvtriton.") or any(part.startswith("_") for part in fullname.split(".")[1:]):
            return None  # not kvtriton's, or a private name (``python -m kvtriton`` asks for kvtriton.__main__)
        after = sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else []
        for finder in after:
            find = getattr(finder, "find_spec", None)
            found: object = find(fullname, path, target) if callable(find) else None
            if isinstance(found, ModuleSpec):
                return found
        meant = _closest_module(fullname)
        hint = f"; did you mean {meant!r}?" if meant is not None else ""
        raise ModuleNotFoundError(f"No module named {fullname!r}{hint} ({_ENTRY_MODULES})", name=fullname)


def _public_modules() -> list[str]:
    """Every module of kvtriton with no private part in its name, found from the files (nothing is imported)."""
    import pkgutil  # only when a kvtriton module is missing

    found: list[str] = []
    packages: list[tuple[str, Sequence[str]]] = [("kvtriton", list(__path__))]
    while packages:
        prefix, paths = packages.pop()
        for module in pkgutil.iter_modules(paths):
            if module.name.startswith("_"):
                continue
            name = f"{prefix}.{module.name}"
            found.append(name)
            if module.ispkg:
                packages.append((name, [f"{path}/{module.name}" for path in paths]))
    return sorted(found)


def _closest_module(missing: str) -> str | None:
    """The public kvtriton module ``missing`` was most likely meant to be: its last part is compared first
    (``kvtriton.vllm`` means ``kvtriton.integrations.vllm``, not ``kvtriton.cli``), then the whole name."""
    import difflib  # only when a kvtriton module is missing

    candidates = _public_modules()
    last = missing.rpartition(".")[2]

    def likeness(candidate: str) -> tuple[float, float]:
        return (
            difflib.SequenceMatcher(None, last, candidate.rpartition(".")[2]).ratio(),
            difflib.SequenceMatcher(None, missing, candidate).ratio(),
        )

    best = max(candidates, key=likeness, default=None)
    if best is None:
        return None
    last_ratio, whole_ratio = likeness(best)
    return best if last_ratio >= 0.75 or whole_ratio >= 0.8 else None


def _install_module_suggestions() -> None:
    """Append the finder once per process (a reload of kvtriton finds the one already there)."""
    for finder in sys.meta_path:
        if type(finder).__module__ == __name__ and type(finder).__name__ == _ModuleSuggestions.__name__:
            return
    sys.meta_path.append(_ModuleSuggestions())


_install_module_suggestions()


def __getattr__(name: str) -> object:
    if name not in _WORKER_NAMES:
        raise AttributeError(f"module 'kvtriton' has no attribute {name!r}")
    value = getattr(importlib.import_module("kvtriton.worker"), name)
    globals()[name] = value
    return value


__all__ = [
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "FilterReusedOffloadingManager",
    "GPULoadStoreSpec",
    "HostSlab",
    "KVLayout",
    "LoadStoreSpec",
    "LookupResult",
    "ManagerStats",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PageableSlabWarning",
    "PagedKV",
    "PrepareStoreOutput",
    "ReqContext",
    "SlabPinningError",
    "TransferBackend",
    "TransferEngine",
    "TransferLane",
    "TransferResult",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]
