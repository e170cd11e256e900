"""kvtriton: offload the paged KV cache of an LLM server to host memory.

The scheduler side (keys, specs, managers) imports neither torch nor triton;
the worker-side names (``PagedKV``, ``HostSlab``, ``TransferEngine``, ...) are
imported from :mod:`kvtriton.worker` on first use, so ``import kvtriton``
stays light in a scheduler process. ``__all__`` below is the public list that
docs/usage.md documents; each subpackage has its own.
"""

from __future__ import annotations

import importlib
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

__version__ = "0.1.0"

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
