"""A remote tier's lookups: vLLM's asynchronous lookup bookkeeping over one bounded ``exist`` per scheduler step.

The scheduler gets RETRY until the step's batch has answered (vLLM's
``AsyncLookupManager`` runs :meth:`RemoteLookups.batch_lookup` on its own
thread); a tier that is not up answers every key False at once, and a store
that does not answer within ``timeout_s`` makes the whole batch misses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from typing_extensions import override

from kvtriton.integrations.remote._metrics import FailureReason, failure_reason
from kvtriton.integrations.remote._supervisor import Supervisor, TierState
from kvtriton.integrations.vllm import AsyncLookupManager, OffloadKey, ReqContext


class RemoteLookups(AsyncLookupManager):
    """vLLM's async lookup bookkeeping; each step's keys are checked in one bounded ``exist``."""

    def __init__(self, tier_type: str, supervisor: Supervisor, object_key: Callable[[OffloadKey], str]) -> None:
        super().__init__(tier_type=tier_type)
        self._remote = supervisor
        self._object_key = object_key

    @override
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self.exists(keys)

    def exists(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Which ``keys`` the store holds, in one ``exist``; all False when down or past the timeout."""
        supervisor = self._remote
        counters = supervisor.counters
        store = supervisor.store
        with supervisor.lock:
            counters.lookups += len(keys)
        if supervisor.state is not TierState.UP or store is None:
            counters.count_failure(0.0, FailureReason.REFUSED)
            return [False] * len(keys)
        object_keys = [self._object_key(key) for key in keys]
        started = time.monotonic()
        found = supervisor.bounded(lambda: store.exist(object_keys))
        seconds = time.monotonic() - started
        if not isinstance(found, list) or len(found) != len(keys):
            counters.count_failure(seconds, failure_reason(found))
            return [False] * len(keys)
        counters.count_op(seconds)
        with supervisor.lock:
            counters.lookup_hits += sum(found)
        return found
