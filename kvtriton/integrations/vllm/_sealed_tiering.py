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
Seal off the scheduler thread (cascades)
    A cascade's seals (xxh3 over every chunk, 0.4-2.7 ms for 16-80 MiB) would
    hold up vLLM's scheduler thread, and with it every request of the batch.
    So the jobs of a cascade (``complete_store``) and of a request-level
    cascade are sealed on one background thread instead, and the tier is
    handed each job only once its seals are written: vLLM calls the tier's
    ``submit_store`` right after ``create_store_job``, and that call is held
    (:meth:`SealedTieringManager._submit_when_sealed`) until the seal thread
    is done, then made by the scheduler's next ``prepare_store``,
    ``complete_store`` or ``on_schedule_end`` (or at once when the seal was
    already done): the tier gets the chunk up to one step later than before.
    Meanwhile the slots stay pinned (the job is registered, as vLLM registers
    it), ``has_pending_work`` stays true so the engine keeps stepping,
    ``reset_cache`` waits for the seals first, and
    ``shutdown`` cancels the seals not yet begun and joins the thread before
    the primary's memory goes. A seal that raises fails the store job: the
    tier never sees it, and vLLM learns it from the tier's
    ``get_finished_jobs`` like any failed store (the slots are unpinned, the
    failure counted). A peer's read through the ``ParentManager`` is still
    sealed on the calling thread: that tier reads the slots as soon as
    ``create_store_job`` returns, with no ``submit_store`` to hold.
Verify (the tier's ``get_finished_jobs``, then ``_complete_promotion``)
    When a tier reports a promotion done, before vLLM's orchestrator marks the
    slots ready, every key the tier says it loaded is verified in its slot. A
    faulty key is taken out of the job's ``successful_keys``: vLLM then frees
    its slot (``complete_write(..., False)``), forgets that the request would
    load it from the tier, and the engine recomputes the block. The fault is
    counted in ``vllm:kv_offload_integrity_failures{tier,reason}`` with a
    rate-limited WARNING (:mod:`kvtriton.integrations.vllm._integrity_report`).
Verify off the manager lock
    Verifying is the seal's cost again (0.4-2.7 ms a chunk), and vLLM polls the
    tiers with its manager lock held, which the scheduler waits for. So the
    seals of a finished promotion are checked on the seal thread: the tier's
    result is held back from vLLM (:meth:`SealedTieringManager._verified_promotions`)
    until the check is done. The poll that starts a check waits for it up to
    :data:`CHECK_WAIT_S`: a check done by then (a few chunks' worth) hands the
    promotion over in that same poll, so the request it serves is not kept a
    scheduler step longer than vLLM's own tiering keeps it; a longer check is
    handed over at the next poll after it is done (the scheduler's next lookup,
    ``prepare_store`` or ``on_schedule_end``, or the tier-poll thread's
    round), the scheduler having waited at most that bound. Meanwhile the job
    stays registered, so its
    slots stay write-pending: a lookup of its keys answers HIT_PENDING, never
    HIT, until the verdict is in; ``has_pending_work`` stays true;
    ``reset_cache`` waits for the checks; ``shutdown`` stops them with the
    seals. A check that raises fails every key of its job (a miss, logged, and
    quarantined as below, uncounted: no fault was found). A promotion
    whose result reaches ``_complete_promotion`` unchecked (a tier reporting a
    job it was never handed through the gate) is verified there, on the
    calling thread: no chunk becomes a hit unverified.
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

Tiers that seal their own (``kvtriton_encryption``)
    An encrypting spec's tiers (kvtriton's remote tiers, each value a box
    sealed with its tenant's key: :mod:`kvtriton.integrations.vllm._encryption`)
    are named in ``self_sealing_tiers``: the box's tag is their chunks'
    integrity check, made in the cipher's one pass, so none of the steps above
    applies to them (no xxh3 seal before a cascade, no check after a
    promotion; a box that fails to open is the tier's own counted miss).

Tiers handed ciphertext (``kvtriton_encryption``, vLLM's ``fs`` tier)
    An encrypting spec builds vLLM's fs tier over an egress area
    (:mod:`kvtriton.integrations.vllm._egress`), not over the primary's
    region, and names it in ``egress_tiers``. Each job is handed to the tier
    as a copy whose ``chunk_ids`` are egress rows (vLLM's own job, which it
    unpins and completes by key, keeps the primary slots). A cascade takes a
    row per chunk (the chunks beyond the free rows are left out of the tier's
    copy: a skipped store, never a plaintext one), and the seal thread seals
    each slot with its request's tenant's key into its row before the tier is
    handed the job, as above; the rows come back when the tier reports the
    job. A promotion takes a row per chunk for the tier to read the files
    into (too few free, or no tenant on the request: the promotion fails, a
    miss), and the seal thread opens each row into its slot, off the manager
    lock, as it checks seals above. The box's tag is the seal: no xxh3 for
    these chunks; a box that does not open is a fault as above, counted as
    ``decrypt_<reason>``, its file removed and its key quarantined.

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

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures

import numpy as np
from typing_extensions import TypeVar, override

from kvtriton._integrity import IntegrityFault, seal_in_place, verify
from kvtriton.encryption import SealedBox
from kvtriton.integrations.vllm._egress import EgressCipher
from kvtriton.integrations.vllm._identity import KVIdentity
from kvtriton.integrations.vllm._integrity_report import Fault, IntegrityReport
from kvtriton.integrations.vllm._surface import (
    CPUPrimaryTierOffloadingManager,
    FileSystemTierManager,
    JobId,
    JobMetadata,
    JobResult,
    OffloadingConnectorStats,
    SecondaryTierManager,
    TieringOffloadingManager,
    TransferJob,
    request_tenant,
    vllm_base,
)

logger = logging.getLogger(__name__)

_Result = TypeVar("_Result")

IDENTITY_INFO_KEYS = ("kvtriton_identity", "kvtriton_identity_source")
"""The labels the primary tier's ``vllm:kv_offload_config_info`` series gains: the fingerprint and its source."""

QUARANTINE_KEYS = 65536
"""Faulty keys remembered per tier (the oldest forgotten first): each then costs one more faulty read, never more."""


CHECK_WAIT_S = 0.002
"""How long a poll waits, under vLLM's manager lock, for the promotion checks it has just started (0.4-2.7 ms a
chunk for a seal): checks done by then are handed to vLLM in that poll, a step sooner than at the next poll."""

SEAL_THREAD_NAME = "kvtriton_seal"
"""The name (prefix) of the thread that seals cascaded chunks off vLLM's scheduler thread."""


def _loaded_slots(job: TransferJob, result: JobResult) -> list[tuple[vllm_base.OffloadKey, int]]:
    """The ``(key, chunk_id)`` slots a finished promotion says it filled: the chunks to check."""
    loaded = set(job.keys if result.success else result.successful_keys or ())
    return [(key, chunk_id) for key, chunk_id in zip(job.keys, job.chunk_ids.tolist()) if key in loaded]


def tier_label(index: int, tier: SecondaryTierManager) -> str:
    """The ``tier`` label vLLM's orchestrator gives secondary tier ``index`` (``"1:fs"``)."""
    return f"{index + 1}:{tier.tier_type}"


class SealingStopped(RuntimeError):
    """The manager shut down while a job's slots were still being sealed: the rest of them are not."""


Faults = list[tuple[vllm_base.OffloadKey, Fault]]
"""The keys of a promotion whose chunk failed its seal check (or, encrypted, did not open), each with the reason."""


@dataclasses.dataclass(eq=False)
class _PendingVerification:
    """A promotion its tier reports done, held back from vLLM until the seal thread has checked its chunks."""

    result: JobResult
    tier_idx: int
    faults: Future[Faults]
    """Done when every loaded chunk is checked; holds the exception when the check itself failed."""


@dataclasses.dataclass(eq=False)
class _PendingSeal:
    """A cascade's store job whose slots are being sealed: its tier is handed the job only once that is done."""

    job: TransferJob
    tier_idx: int
    sealed: Future[None]
    """Done when every slot of the job is sealed; holds the exception when a seal failed."""
    tier_job: TransferJob
    """What the tier is handed: ``job`` itself, or for an egress tier its copy over egress rows."""
    submit_store: Callable[[TransferJob], None] | None = None
    """The tier's own ``submit_store``, once vLLM has called it for this job: the call waits here for the seals."""


HOST_MEMORY_PATH = "vllm:kv_offload_kvtriton_host_memory_path"
"""The gauge of the host memory the ranks' copies go through (the slowest rank's ``HostMemoryPath``): 0 pinned in
place, 1 pinned ``cudaHostAlloc`` memory, 2 pageable (CUDA refused to pin, as in confidential computing)."""


def host_memory_path_definition() -> dict[str, vllm_base.OffloadingMetricMetadata]:
    """:data:`HOST_MEMORY_PATH` as the tiered spec declares it (vLLM's logger refuses an undeclared metric)."""
    return {
        HOST_MEMORY_PATH: vllm_base.OffloadingGaugeMetadata(
            documentation=(
                "Host memory kvtriton's copies go through: 0 pinned in place (cudaHostRegister), 1 pinned "
                "cudaHostAlloc memory, 2 pageable (registration refused, as in confidential computing: slower copies)."
            ),
        )
    }


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
        host_memory_path: Callable[[], int | None] = lambda: None,
        self_sealing_tiers: Collection[int] = (),
        egress: EgressCipher | None = None,
        egress_tiers: Collection[int] = (),
    ) -> None:
        """``self_sealing_tiers``: the indexes of the tiers whose values are sealed boxes; ``egress_tiers``: those
        built over ``egress``'s area, handed ciphertext (see the module docstring)."""
        tiers = list(secondary_tiers)
        self._self_sealing = frozenset(self_sealing_tiers)
        self._egress_tiers = frozenset(egress_tiers)
        if self._egress_tiers and egress is None:
            raise ValueError(f"egress_tiers {sorted(self._egress_tiers)} need the egress area they are built over")
        self._egress = egress
        self._egress_rows: dict[JobId, list[int]] = {}
        """The egress rows of each job handed to an egress tier, until the tier reports it (or its seal fails)."""
        self._landing_boxes: dict[JobId, SealedBox] = {}
        """The tenant's box of each promotion from an egress tier, until its rows are opened."""
        self.egress_left_out = 0
        """Chunks an egress tier was not handed (no free egress row, or no tenant on the request)."""
        self._warned_egress = False
        self._host_memory_path = host_memory_path
        """The region's host memory path (None until a rank took its slab), read for :data:`HOST_MEMORY_PATH`."""
        # Set before vLLM's constructor, which may start its tier-poll thread: that thread already asks the
        # tiers for finished jobs, through the gates installed here.
        self._pending_seals: dict[JobId, _PendingSeal] = {}
        self._failed_seals: list[list[JobResult]] = [[] for _ in tiers]
        """Per tier, the store jobs whose seal failed, reported as failed through the tier's ``get_finished_jobs``."""
        self._promotions: dict[JobId, TransferJob] = {}
        """The promotions handed to a tier (through the gate), until the tier reports them."""
        self._verifying: dict[JobId, _PendingVerification] = {}
        """Finished promotions held back from vLLM while the seal thread checks their chunks, in job order."""
        self._verdicts: dict[JobId, Faults | None] = {}
        """Checked promotions handed to vLLM, until its ``_complete_promotion``: the faulty keys (None: the check
        itself failed, every key is a miss)."""
        self._draining = False
        """Set while ``reset_cache`` runs: a tier's finished promotions are checked before they are returned."""
        self._cascading = False
        self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=SEAL_THREAD_NAME)
        self._sealing_stopped = threading.Event()
        for tier_idx, tier in enumerate(tiers):
            if tier_idx not in self._self_sealing:
                self._gate(tier_idx, tier)
        super().__init__(primary_tier, tiers, tier_poll_interval_s)
        self.identity = identity
        """What every chunk's seal names; shown on the primary's config info series."""
        self.seal_off_thread = True
        """Whether a cascade's seals and a promotion's checks run on the seal thread (the default) or on the calling
        thread, under vLLM's manager lock, as they did before; ``bench/tiers.py`` measures the scheduler's step time
        both ways."""
        view = primary_tier.get_kv_memoryview()  # (num_chunks, chunk_bytes)
        self._region = np.frombuffer(view, dtype=np.uint8)
        self._chunk_bytes = view.nbytes // max(1, len(view))
        self.integrity: list[IntegrityReport] = [
            IntegrityReport(tier_label(index, tier)) for index, tier in enumerate(self.secondary_tiers)
        ]
        """Each secondary tier's faults, by reason (the tier's index in ``secondary_tiers``)."""
        self._quarantined: list[dict[vllm_base.OffloadKey, None]] = [{} for _ in self.secondary_tiers]

    def _gate(self, tier_idx: int, tier: SecondaryTierManager) -> None:
        """Route ``tier``'s ``submit_store`` and ``get_finished_jobs`` through this manager, on this instance only.

        vLLM's orchestrator calls ``tier.submit_store(job)`` right after
        ``create_store_job``; the gate holds that call until the job's seals are
        written. A job whose seal failed never reaches the tier, and is reported
        failed among the tier's finished jobs, where vLLM unpins its slots.
        """
        submit_store = tier.submit_store
        submit_load = tier.submit_load
        get_finished_jobs = tier.get_finished_jobs

        def gated_submit_store(job_metadata: TransferJob) -> None:
            self._submit_when_sealed(job_metadata, submit_store)

        def gated_submit_load(job_metadata: TransferJob) -> None:
            tier_job = job_metadata
            if tier_idx in self._egress_tiers:
                landing = self._egress_landing(tier_idx, job_metadata)
                if landing is None:  # the tier never sees it: failed with the tier's next finished jobs
                    self._failed_seals[tier_idx].append(JobResult(job_id=job_metadata.job_id, success=False))
                    return
                tier_job = landing
            self._promotions[job_metadata.job_id] = job_metadata  # its result is checked before vLLM sees it
            submit_load(tier_job)

        def gated_get_finished_jobs() -> Iterable[JobResult]:
            return self._verified_promotions(tier_idx, self._finished_with_failed_seals(tier_idx, get_finished_jobs))

        tier.submit_store = gated_submit_store
        tier.submit_load = gated_submit_load
        tier.get_finished_jobs = gated_get_finished_jobs

    def _chunk(self, chunk_id: int) -> memoryview:
        return self._slot(chunk_id).data

    def _seal_slots(self, slots: Sequence[tuple[vllm_base.OffloadKey, int]]) -> None:
        """Seal each ``(key, chunk_id)`` slot in place; stops between chunks once the manager shuts down."""
        fingerprint = self.identity.fingerprint
        for done, (key, chunk_id) in enumerate(slots):
            if self._sealing_stopped.is_set():
                raise SealingStopped(f"shut down after sealing {done} of the {len(slots)} slots of a store job")
            seal_in_place(self._chunk(chunk_id), key=key, fingerprint=fingerprint)

    def _seal_into_rows(
        self, tier: str, box: SealedBox, slots: Sequence[tuple[vllm_base.OffloadKey, int, int]]
    ) -> None:
        """Seal each ``(key, chunk_id, row)`` slot into its egress row; stops between chunks like a seal."""
        egress = self._egress
        assert egress is not None
        for done, (key, chunk_id, row) in enumerate(slots):
            if self._sealing_stopped.is_set():
                raise SealingStopped(f"shut down after sealing {done} of the {len(slots)} slots of a store job")
            egress.seal(box, key, tier, self._slot(chunk_id), row)

    def _open_rows(self, tier: str, box: SealedBox, slots: Sequence[tuple[vllm_base.OffloadKey, int, int]]) -> Faults:
        """Open each ``(key, chunk_id, row)`` egress row into its slot: the keys whose box did not open, with why."""
        egress = self._egress
        assert egress is not None
        faults: Faults = []
        for done, (key, chunk_id, row) in enumerate(slots):
            if self._sealing_stopped.is_set():
                raise SealingStopped(f"shut down after opening {done} of the {len(slots)} chunks of a promotion")
            failure = egress.open(box, key, tier, row, self._slot(chunk_id))
            if failure is not None:
                faults.append((key, failure))
        return faults

    def _slot(self, chunk_id: int) -> np.ndarray:
        start = chunk_id * self._chunk_bytes
        return self._region[start : start + self._chunk_bytes]

    def _egress_box(self, tier_idx: int, job: TransferJob) -> SealedBox | None:
        """The box of the tenant of ``job``'s request, or None (warned once) when its context names none."""
        assert self._egress is not None
        tenant = request_tenant(job.req_context)
        if tenant is None:
            self._left_out(tier_idx, job, len(job.keys), "its request context names no tenant")
            return None
        return self._egress.box(tenant)

    def _left_out(self, tier_idx: int, job: TransferJob, count: int, why: str) -> None:
        """Count ``count`` chunks of ``job`` an egress tier is not handed, warning the first time."""
        self.egress_left_out += count
        if self._warned_egress:
            logger.debug("kvtriton egress: %d chunk(s) of job %d left out: %s", count, job.job_id, why)
            return
        self._warned_egress = True
        logger.warning(
            "kvtriton encryption: tier %s is not handed %d chunk(s) of %s job %d: %s (a store skipped, a "
            "promotion a miss; never plaintext); later ones are logged at DEBUG",
            tier_label(tier_idx, self.secondary_tiers[tier_idx]),
            count,
            "promotion" if job.is_promotion else "store",
            job.job_id,
            why,
        )

    def _egress_store(self, tier_idx: int, job: TransferJob) -> tuple[TransferJob, Callable[[], None]]:
        """The copy of store ``job`` an egress tier is handed (the chunks that got a row), and the work that seals
        them into their rows."""
        assert self._egress is not None
        keys = list(job.keys)
        box = self._egress_box(tier_idx, job)
        rows = [] if box is None else self._egress.area.take(len(keys))
        if box is not None and len(rows) < len(keys):
            self._left_out(tier_idx, job, len(keys) - len(rows), "every egress row is in use")
        self._egress_rows[job.job_id] = rows
        tier_job = dataclasses.replace(job, keys=keys[: len(rows)], chunk_ids=np.array(rows, dtype=np.int32))
        if box is None or not rows:
            return tier_job, lambda: None
        slots = list(zip(keys, job.chunk_ids.tolist(), rows))
        tier = self.secondary_tiers[tier_idx].tier_type
        return tier_job, functools.partial(self._seal_into_rows, tier, box, slots)

    def _egress_landing(self, tier_idx: int, job: TransferJob) -> TransferJob | None:
        """The copy of promotion ``job`` an egress tier is handed, landing in egress rows; None when it cannot be
        (no tenant, or too few free rows: the promotion fails, a miss)."""
        assert self._egress is not None
        box = self._egress_box(tier_idx, job)
        if box is None:
            return None
        rows = self._egress.area.take(len(job.keys))
        if len(rows) < len(job.keys):
            self._egress.area.give_back(rows)
            self._left_out(tier_idx, job, len(job.keys), "too few egress rows are free to land them")
            return None
        self._egress_rows[job.job_id] = rows
        self._landing_boxes[job.job_id] = box
        return dataclasses.replace(job, chunk_ids=np.array(rows, dtype=np.int32))

    def _give_back_rows(self, job_id: JobId) -> None:
        rows = self._egress_rows.pop(job_id, None)
        if rows:
            assert self._egress is not None
            self._egress.area.give_back(rows)

    def _check_slots(self, slots: Sequence[tuple[vllm_base.OffloadKey, int]]) -> Faults:
        """The ``(key, chunk_id)`` slots whose chunk fails its seal check, with the reason; stops like a seal."""
        fingerprint = self.identity.fingerprint
        faults: Faults = []
        for done, (key, chunk_id) in enumerate(slots):
            if self._sealing_stopped.is_set():
                raise SealingStopped(f"shut down after checking {done} of the {len(slots)} chunks of a promotion")
            fault = verify(self._chunk(chunk_id), key=key, fingerprint=fingerprint)
            if fault is not None:
                faults.append((key, fault))
        return faults

    def _off_the_lock(self, work: Callable[[], _Result]) -> Future[_Result]:
        """``work`` on the seal thread, or, with :attr:`seal_off_thread` False, here and now (as before)."""
        if self.seal_off_thread:
            return self._sealer.submit(work)
        done: Future[_Result] = Future()
        try:
            done.set_result(work())
        except Exception as error:  # noqa: BLE001 -- as the seal thread's future holds it: the job fails, not the step
            done.set_exception(error)
        return done

    @contextlib.contextmanager
    def _cascade(self) -> Generator[None]:
        """While it is open, the store jobs ``create_store_job`` makes are sealed off the scheduler thread."""
        self._cascading = True
        try:
            yield
        finally:
            self._cascading = False

    @override
    def prepare_store(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext
    ) -> vllm_base.PrepareStoreOutput | None:
        self._hand_over_sealed()  # a tier's write starts sooner, and so its slots are unpinned sooner
        return super().prepare_store(keys, req_context)

    @override
    def complete_store(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext, success: bool = True
    ) -> None:
        self._hand_over_sealed()  # the first call after a forward pass, during which the last seals were written
        with self._cascade():
            super().complete_store(keys, req_context, success)

    @override
    def _cascade_existing_chunks_to_request_level_tiers(
        self, keys: Sequence[vllm_base.OffloadKey], req_context: vllm_base.ReqContext, request_level_tiers: set[int]
    ) -> None:
        with self._cascade():
            super()._cascade_existing_chunks_to_request_level_tiers(keys, req_context, request_level_tiers)

    @override
    def create_store_job(
        self, keys: Collection[vllm_base.OffloadKey], req_context: vllm_base.ReqContext, tier_idx: int = 0
    ) -> TransferJob:
        job = super().create_store_job(keys, req_context, tier_idx)
        if tier_idx in self._self_sealing:
            self._stored_anew(tier_idx, job)
            return job
        if tier_idx in self._egress_tiers:
            tier_job, seal = self._egress_store(tier_idx, job)
        else:
            slots = list(zip(job.keys, job.chunk_ids.tolist()))  # taken here: the caller may reuse its collection
            tier_job, seal = job, functools.partial(self._seal_slots, slots)
        if not self._cascading:
            # A peer's read through the ParentManager: its tier reads the slots as soon as this returns.
            seal()
            self._stored_anew(tier_idx, job)
            return tier_job
        sealed = self._off_the_lock(seal)
        self._pending_seals[job.job_id] = _PendingSeal(job, tier_idx, sealed, tier_job)
        return job

    def _stored_anew(self, tier_idx: int, job: TransferJob) -> None:
        quarantined = self._quarantined[tier_idx]
        for key in job.keys:
            quarantined.pop(key, None)  # stored anew: the tier may hold a good chunk again

    def _submit_when_sealed(self, job: TransferJob, submit_store: Callable[[TransferJob], None]) -> None:
        """A tier's ``submit_store``: at once for a job already sealed, else once its seals are written."""
        pending = self._pending_seals.get(job.job_id)
        if pending is None:
            submit_store(job)
            return
        pending.submit_store = submit_store
        if pending.sealed.done():
            self._hand_over(pending)

    def _hand_over(self, pending: _PendingSeal) -> None:
        """Give a sealed job to its tier, or, when its seal failed, fail it for the tier's next finished jobs."""
        del self._pending_seals[pending.job.job_id]
        submit_store = pending.submit_store
        assert submit_store is not None and pending.sealed.done()
        try:
            error = pending.sealed.exception()
        except CancelledError as cancelled:
            error = cancelled
        if error is None:
            pending.job.submit_time = time.monotonic()  # when the tier got it: vLLM times the tier's I/O from here
            pending.tier_job.submit_time = pending.job.submit_time
            self._stored_anew(pending.tier_idx, pending.job)
            submit_store(pending.tier_job)
            return
        self._give_back_rows(pending.job.job_id)
        logger.error(
            "kvtriton could not seal store job %d for tier %s (%d chunks): the job fails, its chunks stay in the "
            "primary",
            pending.job.job_id,
            tier_label(pending.tier_idx, self.secondary_tiers[pending.tier_idx]),
            len(pending.job.keys),
            exc_info=error,
        )
        self._failed_seals[pending.tier_idx].append(JobResult(job_id=pending.job.job_id, success=False))

    def _hand_over_sealed(self) -> None:
        """Give every tier the jobs sealed since the last step that vLLM has already submitted, in job order."""
        for pending in list(self._pending_seals.values()):
            if pending.submit_store is not None and pending.sealed.done():
                self._hand_over(pending)

    def _finished_with_failed_seals(
        self, tier_idx: int, get_finished_jobs: Callable[[], Iterable[JobResult]]
    ) -> Iterable[JobResult]:
        """A tier's ``get_finished_jobs``, with the store jobs whose seal failed (the tier never saw them)."""
        finished = get_finished_jobs()
        failed = self._failed_seals[tier_idx]
        if not failed:
            return finished
        self._failed_seals[tier_idx] = []
        return [*finished, *failed]

    def _verified_promotions(self, tier_idx: int, finished: Iterable[JobResult]) -> list[JobResult]:
        """A tier's finished jobs as vLLM may see them: each promotion only once its chunks are checked.

        A promotion just reported is held and its check started (on the seal
        thread), which this poll waits for up to :data:`CHECK_WAIT_S`; each
        held promotion whose check is done is returned now, in job order, its
        verdict kept for :meth:`_complete_promotion`. While
        ``reset_cache`` drains the tiers, every check is waited for.
        """
        ready: list[JobResult] = []
        started: list[Future[Faults]] = []
        for result in finished:
            job = self._promotions.pop(result.job_id, None)
            slots = [] if job is None else _loaded_slots(job, result)
            if not slots:  # not a promotion, or nothing loaded: nothing to check (nor to open)
                self._give_back_rows(result.job_id)
                self._landing_boxes.pop(result.job_id, None)
                ready.append(result)
                continue
            assert job is not None
            check = self._off_the_lock(self._check_of(tier_idx, job, slots))
            self._verifying[result.job_id] = _PendingVerification(result, tier_idx, check)
            started.append(check)
        if started:
            wait_for_futures(started, timeout=CHECK_WAIT_S)
        for job_id, pending in list(self._verifying.items()):
            if pending.tier_idx != tier_idx:
                continue
            if self._draining:
                wait_for_futures([pending.faults])
            if not pending.faults.done():
                continue
            del self._verifying[job_id]
            self._give_back_rows(job_id)  # opened (or failed): the rows are free for the next job
            self._verdicts[job_id] = self._verdict(tier_idx, job_id, pending.faults)
            ready.append(pending.result)
        return ready

    def _check_of(
        self, tier_idx: int, job: TransferJob, slots: list[tuple[vllm_base.OffloadKey, int]]
    ) -> Callable[[], Faults]:
        """The work that checks a promotion's loaded ``slots``: their seals, or for an egress tier the opening of
        their rows into them."""
        if tier_idx not in self._egress_tiers:
            return functools.partial(self._check_slots, slots)
        box = self._landing_boxes.pop(job.job_id)
        row_of = dict(zip(job.keys, self._egress_rows[job.job_id]))
        tier = self.secondary_tiers[tier_idx].tier_type
        return functools.partial(self._open_rows, tier, box, [(key, chunk, row_of[key]) for key, chunk in slots])

    def _verdict(self, tier_idx: int, job_id: JobId, faults: Future[Faults]) -> Faults | None:
        """A finished check's faulty keys, or None (logged) when the check itself failed."""
        try:
            return faults.result()
        except (Exception, CancelledError) as error:  # the promotion fails, not the step
            logger.error(
                "kvtriton could not check the chunks of promotion job %d from tier %s: every key of it is a miss",
                job_id,
                tier_label(tier_idx, self.secondary_tiers[tier_idx]),
                exc_info=error,
            )
            return None

    @override
    def on_schedule_end(self, context: vllm_base.ScheduleEndContext) -> None:
        self._hand_over_sealed()  # first, so that the tiers' own end of step sees them
        super().on_schedule_end(context)

    @override
    def has_pending_work(self) -> bool:
        # A job held for its seal needs a step to reach its tier, even where vLLM 0.34 lets a polled tier idle.
        # A promotion held for its check needs a step (a poll) to reach vLLM too.
        pending = bool(self._pending_seals) or bool(self._verifying) or any(self._failed_seals)
        return pending or super().has_pending_work()

    @override
    def reset_cache(self) -> None:
        # vLLM drains every tier's jobs, then expects none in flight: the held ones must reach their tier first.
        wait_for_futures([pending.sealed for pending in self._pending_seals.values()])
        self._hand_over_sealed()
        # vLLM then drains the tiers and takes their finished jobs: every promotion's check is waited for there.
        self._draining = True
        try:
            super().reset_cache()
        finally:
            self._draining = False

    @override
    def shutdown(self) -> None:
        # Before vLLM tears the tiers and the primary's memory down: no seal may be writing into it then. The seal
        # in progress stops after its chunk; the jobs not begun are cancelled (their slots are never handed over).
        self._sealing_stopped.set()
        self._sealer.shutdown(wait=True, cancel_futures=True)
        super().shutdown()

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
        if job_metadata.tier_idx in self._self_sealing:  # opened by the tier itself, box by box
            super()._complete_promotion(job_metadata, completed_job)
            return
        faults: Faults | None
        if completed_job.job_id in self._verdicts:
            faults = self._verdicts.pop(completed_job.job_id)
        elif job_metadata.tier_idx in self._egress_tiers:  # never landed apart, so never opened: nothing to serve
            faults = None if _loaded_slots(job, completed_job) else []
        else:  # never held for a check (see the module docstring): checked here, never served unchecked
            faults = self._check_slots(_loaded_slots(job, completed_job))
        if faults is None:  # unchecked: a miss, and kept from being promoted again at once (that would loop)
            for key, _ in _loaded_slots(job, completed_job):
                self._quarantine(job_metadata.tier_idx, key)
            completed_job = dataclasses.replace(completed_job, success=False, successful_keys=None)
        elif faults:
            for key, fault in faults:
                self._reject(job_metadata.tier_idx, key, fault)
            loaded = set(job.keys if completed_job.success else completed_job.successful_keys or ())
            faulty = {key for key, _ in faults}
            good = tuple(key for key in job.keys if key in loaded and key not in faulty)
            completed_job = dataclasses.replace(completed_job, success=False, successful_keys=good or None)
        super()._complete_promotion(job_metadata, completed_job)

    def _reject(self, tier_idx: int, key: vllm_base.OffloadKey, fault: Fault) -> None:
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
        self._quarantine(tier_idx, key)

    def _quarantine(self, tier_idx: int, key: vllm_base.OffloadKey) -> None:
        """Keep ``key`` from being promoted from tier ``tier_idx`` until this engine stores it there anew."""
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
        path = self._host_memory_path()
        if path is not None:
            faults.set_gauge(HOST_MEMORY_PATH, path)
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
