"""MooncakeStoreTier: a secondary tier over Mooncake Store, shared by every instance of a deployment.

vLLM's tiered offloading (``vllm.v1.kv_offload.tiering``, 0.33 and 0.34) loads it by
module path::

    {"type": "MooncakeStoreTier", "module_path": "kvtriton.integrations.mooncake",
     "master_server_address": "10.0.0.5:50051", "namespace": "prod"}

behind vLLM's own ``TieringOffloadingSpec`` (vLLM's CPU primary) or kvtriton's
tiered spec. Every configuration key is in :class:`MooncakeTierConfig`
(kvtriton/integrations/mooncake/_config.py) and docs/mooncake.md.

How it moves data
    The primary tier's host memory is registered with the store once; a
    cascade is one ``batch_put_from`` reading the pinned primary slots, a
    promotion one ``batch_get_into`` writing into the allocated ones. No chunk
    passes through Python ``bytes``. A get that returns anything but the exact
    chunk size is a miss for that key (the slot is handed back, never used).

How it fails closed
    Object keys are filed under the engine's identity fingerprint
    (:mod:`kvtriton.integrations.vllm._identity`: model, weights, dtypes,
    layout, compression, row format, namespace). Every value is the chunk
    followed by its 64-byte seal (:mod:`kvtriton._integrity`), put from the
    primary's slot and a small registered seal buffer in one
    ``batch_put_from_multi_buffers``; a promotion reads both back in one
    ``batch_get_into_multi_buffers`` and verifies the seal before the chunk
    becomes a hit. A value that fails (other bytes, another key's or another
    identity's chunk, a torn or over-long one, an older format) is a miss for
    that key only, counted in ``vllm:kv_offload_integrity_failures{tier,reason}``
    with a rate-limited WARNING (:mod:`kvtriton.integrations.vllm._integrity_report`).

How it stays out of the scheduler's way
    Lookups go through vLLM's ``AsyncLookupManager``: the scheduler gets RETRY
    until one batched ``batch_is_exist`` per step has answered. On vLLM 0.34
    a key this tier has just stored is marked present there
    (``mark_present``), so a MISS cached from before the put, or a probe
    still in flight, no longer hides it from the next request. Store and load
    jobs run on ``io_threads`` threads and complete through
    ``get_finished_jobs``; a promotion that loaded only some keys reports them.

How it fails
    Every failure is a miss, never a hang or wrong data. The master's RPC
    timeout is the configured ``timeout_s``; every lookup, load and store has a
    deadline ``timeout_s`` after it was asked for, past which it is a miss or a
    failed store, counted by reason, and the tier is *degraded* (retried after
    ``retry_backoff_s``, doubling up to ``retry_backoff_max_s``). A load still
    inside the store at its deadline is abandoned: vLLM gets the failure then,
    and the slots the call may still write are kept aside until it returns
    (docs/tiers.md, "Deadlines, degraded tiers and abandoned calls"). Once an operation finds the master
    unreachable the tier is *down*: lookups miss and jobs fail at once, without
    touching the network, while one background thread probes the master every
    ``reconnect_interval_s`` and brings the tier back when it answers.
    :meth:`MooncakeStoreTier.stats` counts the failures and the time they took.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from typing_extensions import override

from kvtriton.integrations import mooncake_version_problem
from kvtriton.integrations.mooncake._client import (
    MooncakeClient,
    StoreClient,
    is_connection_error,
    open_store,
    set_up_store,
)
from kvtriton.integrations.mooncake._config import MooncakeTierConfig
from kvtriton.integrations.mooncake._setup_failure import setup_failure_line
from kvtriton.integrations.remote import (
    RemoteClient,
    RemoteTier,
    RemoteTierMetrics,
    RemoteTierSettings,
    RemoteTierStats,
    TierState,
    chunk_identity,
    kv_identity,
)
from kvtriton.integrations.vllm import ConfigInfoMapping

logger = logging.getLogger(__name__)

__all__ = [
    "MooncakeClient",
    "MooncakeStoreTier",
    "MooncakeTierConfig",
    "MooncakeTierMetrics",
    "MooncakeTierStats",
    "StoreClient",
    "TierState",
    "chunk_identity",
    "is_connection_error",
    "kv_identity",
    "open_store",
]

MooncakeTierMetrics = RemoteTierMetrics.with_prefix("mooncake")
"""The Prometheus metrics the tier adds to vLLM's offloading metrics (``vllm:kv_offload_mooncake_*``), labelled by
tier as vLLM labels it (:class:`~kvtriton.integrations.remote.RemoteTierMetrics`)."""

MooncakeTierStats = RemoteTierStats
"""The tier's counters (:meth:`MooncakeStoreTier.stats`): the remote tiers' stats."""


class MooncakeStoreTier(RemoteTier[MooncakeTierConfig]):
    """A vLLM secondary tier over Mooncake Store (see the module docstring): the remote-tier base with a
    Mooncake client. Its keys are :class:`MooncakeTierConfig`'s (docs/mooncake.md)."""

    backend: ClassVar[str] = "Mooncake"
    metrics: ClassVar[RemoteTierMetrics] = MooncakeTierMetrics
    config_type: ClassVar[type[RemoteTierSettings]] = MooncakeTierConfig

    @classmethod
    @override
    def installation_problem(cls) -> str | None:
        return mooncake_version_problem()

    @override
    def describe_store(self) -> str:
        return f"master {self.config.master_server_address}"

    _failed_setups: int = 0
    """Setups that failed in a row (on the supervisor thread): the first says why at WARNING, the rest at DEBUG."""

    @override
    def open_client(self) -> RemoteClient | None:
        store = set_up_store(self.config)
        if isinstance(store, int):
            logger.log(
                logging.DEBUG if self._failed_setups else logging.WARNING,
                "%s",
                setup_failure_line(self.config, store, who=self.who),
            )
            self._failed_setups += 1
            return None
        if self._failed_setups:
            logger.info(
                "%s: set up against %s after %d failed attempt(s)", self.who, self.endpoint, self._failed_setups
            )
            self._failed_setups = 0
        return MooncakeClient(store)

    @classmethod
    @override
    def config_info_keys(cls, tier_config: dict[str, object]) -> tuple[str, ...]:
        return ("mooncake_master", "mooncake_namespace_digest", "mooncake_identity")

    @override
    def config_info(self) -> ConfigInfoMapping:
        return {
            "mooncake_master": self.config.master_server_address,
            "mooncake_namespace_digest": self.keyspace.digest,
            "mooncake_identity": self.identity.hex,
        }
