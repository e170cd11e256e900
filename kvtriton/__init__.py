"""kvtriton: offload the paged KV cache of an LLM server to host memory.

The scheduler side (keys, specs, managers) imports neither torch nor triton;
worker-side names are imported on first use.
"""

from __future__ import annotations

from kvtriton.keys import OffloadKey, get_offload_block_hash, get_offload_group_idx, make_offload_key
from kvtriton.specs import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
)

__version__ = "0.1.0"

__all__ = [
    "CPULoadStoreSpec",
    "GPULoadStoreSpec",
    "LoadStoreSpec",
    "LookupResult",
    "OffloadKey",
    "OffloadingEvent",
    "PrepareStoreOutput",
    "ReqContext",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]
