"""Scheduler side: which blocks live in the host slab, and in which slot.

Imports neither torch nor triton; slot ids leave as numpy int64 arrays inside
``kvtriton._offload_types.CPULoadStoreSpec``.
"""

from __future__ import annotations

from kvtriton.manager._base import OffloadingManager
from kvtriton.manager._cpu import CPUOffloadingManager
from kvtriton.manager._reuse_filter import FilterReusedOffloadingManager, ReuseSignal
from kvtriton.manager._slot_pool import SlotPool
from kvtriton.manager._stats import ManagerStats
from kvtriton.manager.policies import (
    POLICIES,
    ARCCachePolicy,
    Block,
    CachePolicy,
    LRUCachePolicy,
    make_policy,
    policy_names,
)

__all__ = [
    "ARCCachePolicy",
    "Block",
    "CPUOffloadingManager",
    "CachePolicy",
    "FilterReusedOffloadingManager",
    "LRUCachePolicy",
    "ManagerStats",
    "OffloadingManager",
    "POLICIES",
    "ReuseSignal",
    "SlotPool",
    "make_policy",
    "policy_names",
]
