"""vLLM's tiering orchestrator behind kvtriton's tiered spec: every chunk a secondary tier reads is sealed, every
chunk it returns is verified before it becomes a hit.

:class:`SealedTieringManager` is vLLM 0.33's ``TieringOffloadingManager`` with
three of its steps extended, for any secondary tier (vLLM's ``fs``, ``obj``,
``p2p``, an out-of-tree one) and for either primary kvtriton's spec builds
(kvtriton's own, or vLLM's with a vLLM eviction policy, over the same region):

Seal (``create_store_job``)
    Every job that lets a tier read primary slots (a cascade, a request-level
    cascade, a peer's read through the ``ParentManager``) passes here, right
    after the slots are pinned: each slot's last
    :data:`~kvtriton._integrity.SEAL_BYTES` (reserved by
    :class:`~kvtriton.worker._shared_region.RegionLayout`) get the seal of the
    bytes before them, the engine's identity fingerprint and the key. The
    tier then stores the seal with the chunk, as bytes like any others.
Verify (``_complete_promotion``)
    When a tier reports a promotion done, before vLLM's orchestrator marks the
    slots ready, every key the tier says it loaded is verified in its slot. A
    faulty key is taken out of the job's ``successful_keys``: vLLM then frees
    its slot (``complete_write(..., False)``), forgets that the request would
    load it from the tier, and the engine recomputes the block. The fault is
    counted in ``vllm:kv_offload_integrity_failures{tier,reason}`` with a
    rate-limited WARNING (:mod:`kvtriton.integrations.vllm._integrity_report`).
Size (``_initiate_promotion``)
    Before vLLM's fs tier reads a chunk file, its length is checked: a file
    shorter than a sealed chunk (cut short, empty) is
    :attr:`~kvtriton._integrity.IntegrityFault.TORN`, a longer one
    :attr:`~kvtriton._integrity.IntegrityFault.WRONG_SIZE`, each rejected as
    a faulty chunk is below. vLLM's own read would fail the first as a short
    read that kvtriton's count never sees, and would read one chunk of the
    second and never the bytes after it.
Quarantine (``_initiate_promotion``)
    A key that failed is not promoted from that tier again until this engine
    stores it to that tier anew: the tier still answers HIT for it (vLLM's fs
    tier caches its answer per request), and promoting it again would loop
    (the livelock vLLM's own tiers avoid with ``mark_miss``). vLLM's fs tier
    also loses the faulty file, as it loses a file cut short, so that the next
    cascade writes the chunk afresh instead of skipping a file that exists.

Why here and not in the primary's ``complete_write``: by then vLLM has already
counted the key as loaded from the tier, and nothing would stop the next lookup
from promoting the same faulty chunk again. vLLM learns which keys of a
promotion failed from the tier's ``JobResult.successful_keys`` only, so that is
what is rewritten.

The primary tier's ``vllm:kv_offload_config_info`` series also gains the
identity (:data:`IDENTITY_INFO_KEYS`).

Import it through :mod:`kvtriton.integrations.vllm`, which checks that vLLM
is installed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Collection, Sequence

import numpy as np
from typing_extensions import override

from kvtriton._integrity import IntegrityFault, seal_in_place, verify
from kvtriton.integrations.vllm._identity import KVIdentity
from kvtriton.integrations.vllm._integrity_report import IntegrityReport
from kvtriton.integrations.vllm._surface import (
    CPUPrimaryTierOffloadingManager,
    FileSystemTierManager,
    JobMetadata,
    JobResult,
    OffloadingConnectorStats,
    SecondaryTierManager,
    TieringOffloadingManager,
    TransferJob,
    vllm_base,
)

logger = logging.getLogger(__name__)

IDENTITY_INFO_KEYS = ("kvtriton_identity", "kvtriton_identity_source")
"""The labels the primary tier's ``vllm:kv_offload_config_info`` series gains: the fingerprint and its source."""

QUARANTINE_KEYS = 65536
"""Faulty keys remembered per tier (the oldest forgotten first): each then costs one more faulty read, never more."""


def tier_label(index: int, tier: SecondaryTierManager) -> str:
    """The ``tier`` label vLLM's orchestrator gives secondary tier ``index`` (``"1:fs"``)."""
    return f"{index + 1}:{tier.tier_type}"


class SealedTieringManager(TieringOffloadingManager):
    """vLLM's ``TieringOffloadingManager`` that seals what its tiers read and verifies what they return (see the
    module docstring)."""

    def __init__(
        self,
        primary_tier: CPUPrimaryTierOffloadingManager,
        secondary_tiers: list[SecondaryTierManager],
        *,
        identity: KVIdentity,
        tier_poll_interval_s: float,
    ) -> None:
        super().__init__(primary_tier, secondary_tiers, tier_poll_interval_s)
        self.identity = identity
        """What every chunk's seal names; shown on the primary's config info series."""
        view = primary_tier.get_kv_memoryview()  # (num_chunks, chunk_bytes)
        self._region = np.frombuffer(view, dtype=np.uint8)
        self._chunk_bytes = view.nbytes // max(1, len(view))
        self.integrity: list[IntegrityReport] = [
            IntegrityReport(tier_label(index, tier)) for index, tier in enumerate(self.secondary_tiers)
        ]
        """Each secondary tier's faults, by reason (the tier's index in ``secondary_tiers``)."""
        self._quarantined: list[dict[vllm_base.OffloadKey, None]] = [{} for _ in self.secondary_tiers]

    def _chunk(self, chunk_id: int) -> memoryview:
        start = chunk_id * self._chunk_bytes
        return self._region[start : start + self._chunk_bytes].data

    @override
    def create_store_job(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext, tier_idx: int = 0
    ) -> TransferJob:
        job = super().create_store_job(keys, req_context, tier_idx)
        fingerprint = self.identity.fingerprint
        for key, chunk_id in zip(job.keys, job.chunk_ids.tolist()):
            seal_in_place(self._chunk(chunk_id), key=key, fingerprint=fingerprint)
        quarantined = self._quarantined[tier_idx]
        for key in job.keys:
            quarantined.pop(key, None)  # stored anew: the tier may hold a good chunk again
        return job

    @override
    def _initiate_promotion(self, tier_idx: int, key: vllm_base.OffloadKey, req_context: vllm_base.ReqContext) -> bool:
        if key in self._quarantined[tier_idx]:
            return False  # the orchestrator answers MISS: recomputed, not promoted again
        fault = self._chunk_file_fault(self.secondary_tiers[tier_idx], key)
        if fault is not None:
            self._reject(tier_idx, key, fault)
            return False
        return super()._initiate_promotion(tier_idx, key, req_context)

    def _chunk_file_fault(self, tier: SecondaryTierManager, key: vllm_base.OffloadKey) -> IntegrityFault | None:
        """A chunk file of another length than a sealed chunk, caught before vLLM's fs tier reads it.

        vLLM's read would fail a short file as its own short read, which kvtriton's
        count never sees, and never reads past one chunk of a longer file, so the
        seal alone cannot tell an over-long file. One ``stat`` of a file the
        tier's lookup has just found, next to the read of the whole chunk it saves.
        """
        if not isinstance(tier, FileSystemTierManager):
            return None
        try:
            size = os.stat(tier.file_mapper.get_file_name(key)).st_size
        except OSError:
            return None  # gone since the lookup: vLLM's read fails it, a plain miss
        if size < self._chunk_bytes:
            return IntegrityFault.TORN
        if size > self._chunk_bytes:
            return IntegrityFault.WRONG_SIZE
        return None

    @override
    def _complete_promotion(self, job_metadata: JobMetadata, completed_job: JobResult) -> None:
        job = job_metadata.transfer_job
        loaded = set(job.keys if completed_job.success else completed_job.successful_keys or ())
        faulty: set[vllm_base.OffloadKey] = set()
        for key, chunk_id in zip(job.keys, job.chunk_ids.tolist()):
            if key not in loaded:
                continue
            fault = verify(self._chunk(chunk_id), key=key, fingerprint=self.identity.fingerprint)
            if fault is not None:
                faulty.add(key)
                self._reject(job_metadata.tier_idx, key, fault)
        if faulty:
            good = tuple(key for key in job.keys if key in loaded and key not in faulty)
            completed_job = dataclasses.replace(completed_job, success=False, successful_keys=good or None)
        super()._complete_promotion(job_metadata, completed_job)

    def _reject(self, tier_idx: int, key: vllm_base.OffloadKey, fault: IntegrityFault) -> None:
        """Count a faulty chunk, keep its key from being promoted from that tier again, drop a faulty fs file."""
        tier = self.secondary_tiers[tier_idx]
        name = key.hex()
        if isinstance(tier, FileSystemTierManager):
            name = tier.file_mapper.get_file_name(key)
            try:
                os.remove(name)
            except OSError as error:
                logger.debug("could not remove the faulty chunk file %s: %s", name, error)
        self.integrity[tier_idx].record(fault, name)
        quarantined = self._quarantined[tier_idx]
        quarantined[key] = None
        if len(quarantined) > QUARANTINE_KEYS:
            del quarantined[next(iter(quarantined))]

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = super().get_stats()
        faults = OffloadingConnectorStats()
        for report in self.integrity:
            report.add_to(faults)
        if faults.is_empty():
            return stats
        if stats is None:
            return faults
        stats.aggregate(faults)
        return stats

    @override
    def config_info(self) -> Sequence[vllm_base.ConfigInfoMapping]:
        primary, *tiers = super().config_info()
        labels = {"kvtriton_identity": self.identity.hex, "kvtriton_identity_source": self.identity.source}
        return [{**primary, **labels}, *tiers]
