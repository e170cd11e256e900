"""Remote secondary tiers: one base over a store client, and an in-memory store to try and test it.

:class:`RemoteTier` is a vLLM ``SecondaryTierManager`` that does what every
remote tier needs (asynchronous lookups, up/down supervision, bounded calls,
jobs on I/O threads, seals, metrics, stats) over a :class:`RemoteClient`;
a backend adds a client and its configuration. Mooncake Store is one
(:mod:`kvtriton.integrations.mooncake`); :class:`InMemoryStoreTier` is the
smallest, a dict in this process with faults on demand, which the tests use
and docs/tiers.md ("Adding a tier backend") walks through. vLLM loads the
in-memory tier by module path::

    {"type": "InMemoryStoreTier", "module_path": "kvtriton.integrations.remote", "store": "trial"}
"""

from __future__ import annotations

from kvtriton.integrations.remote._client import Outcome, RemoteClient, Segment, Unreachable
from kvtriton.integrations.remote._identity import chunk_identity, kv_identity
from kvtriton.integrations.remote._keyspace import ChunkIdentity, TierKeyspace
from kvtriton.integrations.remote._memory import (
    InMemoryClient,
    InMemoryStore,
    InMemoryStoreTier,
    InMemoryTierConfig,
    in_memory_store,
)
from kvtriton.integrations.remote._metrics import RemoteTierMetrics, RemoteTierStats, vllm_tier_label
from kvtriton.integrations.remote._settings import RemoteTierSettings
from kvtriton.integrations.remote._supervisor import TierState
from kvtriton.integrations.remote._tier import RemoteTier

__all__ = [
    "ChunkIdentity",
    "InMemoryClient",
    "InMemoryStore",
    "InMemoryStoreTier",
    "InMemoryTierConfig",
    "Outcome",
    "RemoteClient",
    "RemoteTier",
    "RemoteTierMetrics",
    "RemoteTierSettings",
    "RemoteTierStats",
    "Segment",
    "TierKeyspace",
    "TierState",
    "Unreachable",
    "chunk_identity",
    "in_memory_store",
    "kv_identity",
    "vllm_tier_label",
]
