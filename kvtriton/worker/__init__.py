"""The worker side: what runs next to the GPU and moves the bytes.

``_layout`` describes the engine's paged KV tensors, ``_slab`` the pinned host
memory they are offloaded into, ``_plan`` turns load/store specs into the
kernels' index pairs, ``_backends`` picks how the copy runs (Triton, DMA, torch)
and ``_engine`` submits transfer jobs on CUDA streams; ``_cudart`` binds the
CUDA runtime calls torch does not, ``_shared_region`` is the host region the
tiered spec shares between processes, ``_numa`` places threads near the GPU.
These modules import torch; nothing here imports the manager or the operator
tools. docs/worker.md describes the path. The names below are the worker's
public list; ``kvtriton`` re-exports the ones a server needs.
"""

from __future__ import annotations

from kvtriton.worker._backends import TransferBackend
from kvtriton.worker._engine import EngineStats, TransferEngine, TransferLane, TransferResult
from kvtriton.worker._layout import KVLayout, PagedKV, byte_view
from kvtriton.worker._plan import TransferDirection
from kvtriton.worker._shared_region import RegionLayout, SharedRegion
from kvtriton.worker._slab import (
    MEMLOCK_NOTE,
    HostMemoryPath,
    HostSlab,
    PageableSlabWarning,
    PinRefusal,
    SlabPinningError,
    mem_available_bytes,
    memlock_limit_bytes,
)
from kvtriton.worker._slot_digests import SlotDigests

__all__ = [
    "EngineStats",
    "HostMemoryPath",
    "HostSlab",
    "KVLayout",
    "PageableSlabWarning",
    "PinRefusal",
    "PagedKV",
    "RegionLayout",
    "SharedRegion",
    "SlabPinningError",
    "TransferBackend",
    "TransferDirection",
    "TransferEngine",
    "TransferLane",
    "TransferResult",
    # for the vLLM worker adapter and the command line
    "MEMLOCK_NOTE",
    "SlotDigests",
    "byte_view",
    "mem_available_bytes",
    "memlock_limit_bytes",
]
