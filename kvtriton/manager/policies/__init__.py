"""Cache policies: one file per policy, chosen by name through the registry."""

from __future__ import annotations

from kvtriton.manager.policies._arc import ARCCachePolicy, ARCState
from kvtriton.manager.policies._base import PENDING, Block, CachePolicy, KeyRun, RequestAwarePolicy, Use, run_keys
from kvtriton.manager.policies._lru import LRUCachePolicy
from kvtriton.manager.policies._registry import POLICIES, canonical_policy_name, make_policy, policy_names

__all__ = [
    "ARCCachePolicy",
    "ARCState",
    "Block",
    "CachePolicy",
    "KeyRun",
    "LRUCachePolicy",
    "PENDING",
    "POLICIES",
    "RequestAwarePolicy",
    "Use",
    "canonical_policy_name",
    "make_policy",
    "policy_names",
    "run_keys",
]
