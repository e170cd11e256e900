"""kvtriton: offload the paged KV cache of an LLM server to host memory.

The scheduler side (keys, specs, managers) imports neither torch nor triton;
the worker-side names (``PagedKV``, ``HostSlab``, ``TransferEngine``, ...) are
imported on first use, so ``import kvtriton`` stays light in a scheduler
process.
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
    from kvtriton.worker._backends import TransferBackend
    from kvtriton.worker._engine import TransferEngine, TransferLane, TransferResult
    from kvtriton.worker._layout import KVLayout, PagedKV
    from kvtriton.worker._slab import HostSlab, PageableSlabWarning, SlabPinningError

__version__ = "0.1.0"

# Worker-side names and the module that defines each; they import torch.
_WORKER_NAMES: dict[str, str] = {
    "HostSlab": "kvtriton.worker._slab",
    "KVLayout": "kvtriton.worker._layout",
    "PageableSlabWarning": "kvtriton.worker._slab",
    "PagedKV": "kvtriton.worker._layout",
    "SlabPinningError": "kvtriton.worker._slab",
    "TransferBackend": "kvtriton.worker._backends",
    "TransferEngine": "kvtriton.worker._engine",
    "TransferLane": "kvtriton.worker._engine",
    "TransferResult": "kvtriton.worker._engine",
}


def __getattr__(name: str) -> object:
    module = _WORKER_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtriton' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
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
