"""Scheduler side: which blocks live in the host slab, and in which slot.

Imports neither torch nor triton; slot ids leave as numpy int64 arrays inside
``kvtriton.specs.CPULoadStoreSpec``.
"""

from __future__ import annotations

from kvtriton.manager.base import OffloadingManager
from kvtriton.manager.cpu import CPUOffloadingManager
from kvtriton.manager.policies import (
    POLICIES,
    ARCCachePolicy,
    Block,
    CachePolicy,
    LRUCachePolicy,
    make_policy,
    policy_names,
)
from kvtriton.manager.reuse_filter import FilterReusedOffloadingManager, ReuseSignal
from kvtriton.manager.slot_pool import SlotPool
from kvtriton.manager.stats import ManagerStats

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
