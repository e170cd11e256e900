"""A secondary tier whose promotions fail with a deferred release, as vLLM 0.34's ``p2p`` tier's can.

Loaded by ``module_path`` (``{"type": "DeferringTier", "module_path":
"tiering_fixtures.deferring_tier"}``). It holds the keys a test puts in
:attr:`DeferringTier.keys`; every promotion from it fails, reporting an event
(vLLM 0.34's ``JobResult.deferred_release``) that the test sets once the
tier's I/O "can no longer write" into the primary's chunks. ``drain_jobs``
sets them all, as vLLM's contract asks. Every store succeeds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from typing_extensions import override
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob


class DeferringTier(SecondaryTierManager):
    """A tier that holds :attr:`keys` and fails every promotion with a deferred release (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keys: set[OffloadKey] = set()
        """The keys the tier answers HIT for."""
        self.releases: list[threading.Event] = []
        """One event per failed promotion, in submission order: set it to release the primary's chunks."""
        self._finished: list[JobResult] = []

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.keys else LookupResult.MISS

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        self.keys.update(job_metadata.keys)
        self._finished.append(JobResult(job_metadata.job_id, True))

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        release = threading.Event()
        self.releases.append(release)
        deferred: dict[str, Any] = {"deferred_release": release}  # vLLM 0.34's field
        self._finished.append(JobResult(job_metadata.job_id, False, **deferred))

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished, self._finished = self._finished, []
        return finished

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def drain_jobs(self) -> None:
        for release in self.releases:
            release.set()
