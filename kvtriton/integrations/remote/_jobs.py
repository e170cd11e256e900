"""A remote tier's store and load jobs: submitted, run on I/O threads, bounded by a deadline, reported, drained.

Every job is one batched ``put`` (a cascade) or ``get`` (a promotion) on one
of ``io_threads`` threads, and reaches vLLM through ``get_finished_jobs``.
Each has a deadline ``timeout_s`` after it was submitted: a job still queued
then fails at once; a load still inside the store is *abandoned*: reported
failed at once, its slots kept aside until the call returns (vLLM 0.34's
``deferred_release``; on 0.33 the call writes the job's own landing memory);
a store still inside the store is counted failed at once and reported when
its call returns. Either way the tier degrades (:class:`Supervisor`).

An encrypting tier (:class:`~kvtriton.integrations.remote._seals.EncryptedSlots`)
takes each job's tenant from its request's context when it is submitted (a
job whose context names none fails: nothing is stored unsealed, nothing
opened with a guessed key); its stores seal into an egress buffer of their
own and its loads always land apart, on the I/O thread.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvtriton.encryption import SealedBox
from kvtriton.integrations.remote._client import Outcome, RemoteClient, Segment
from kvtriton.integrations.remote._metrics import Counters, FailureReason
from kvtriton.integrations.remote._seals import EncryptedSlots, SealedSlots
from kvtriton.integrations.remote._supervisor import Supervisor, TierState
from kvtriton.integrations.vllm import (
    JOB_RESULTS_DEFER_RELEASE,
    JobId,
    JobResult,
    OffloadKey,
    TransferJob,
    failed_load_result,
    mark_stored,
    request_tenant,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvtriton.integrations.vllm import AsyncLookupManager

logger = logging.getLogger(__name__)


class _Phase(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    """An I/O thread is inside the store call."""
    LANDING = "landing"
    """The call returned in time: the I/O thread checks and delivers the result (no deadline applies any more)."""
    DONE = "done"
    ABANDONED = "abandoned"
    """Failed at its deadline and reported; a call it had started may still be inside the store."""


@dataclass
class _Job:
    job_id: JobId
    keys: list[OffloadKey]
    object_keys: list[str]
    pointers: list[int]
    seal_pointers: list[int]
    chunk_ids: list[int]
    is_load: bool
    deadline: float
    submitted: float = 0.0
    future: Future[None] | None = None
    succeeded: list[OffloadKey] = field(default_factory=lambda: [])
    failed: list[OffloadKey] = field(default_factory=lambda: [])
    seconds: float = 0.0
    phase: _Phase = _Phase.QUEUED
    overdue: bool = False
    """The deadline passed while the call ran (counted once; a store then reports failed when the call returns)."""
    call_returned: threading.Event = field(default_factory=threading.Event)
    """Set once no store call of this job can touch memory any more (vLLM 0.34's ``deferred_release``)."""
    box: SealedBox | None = None
    """An encrypting tier's: the box of the job's tenant, which seals its values or opens them."""

    @property
    def kind(self) -> str:
        return "load" if self.is_load else "store"


class JobRunner:
    """The jobs of one tier, from ``submit_*`` to ``get_finished_jobs`` (see the module docstring)."""

    def __init__(
        self,
        *,
        supervisor: Supervisor,
        slots: SealedSlots,
        lookups: AsyncLookupManager,
        object_key: Callable[[OffloadKey], str],
        io_threads: int,
        thread_name: str,
    ) -> None:
        self.supervisor = supervisor
        self.who = supervisor.who
        self.timeout_s = supervisor.settings.timeout_s
        self.counters: Counters = supervisor.counters
        self.lock = supervisor.lock
        self.slots = slots
        self.lookups = lookups
        self.object_key = object_key
        self.jobs: dict[JobId, _Job] = {}
        """Submitted jobs not yet returned by get_finished_jobs (scheduler thread only)."""
        self.in_flight: dict[JobId, _Job] = {}
        """Every job whose call has not returned, reported or not (under ``lock``): drain and shutdown wait on them."""
        self.loads_into_primary = JOB_RESULTS_DEFER_RELEASE and not isinstance(slots, EncryptedSlots)
        """Loads write the primary's slots directly, and a load abandoned at its deadline hands vLLM a
        ``deferred_release`` event (vLLM 0.34). Without it (0.33) a load lands in memory of its own first and is
        copied into the primary only if it returned in time, so a late write never reaches a slot vLLM reused; an
        encrypting tier's loads always land apart, and are opened into the primary only if they returned in time."""
        self._warned_no_tenant = False
        self._finished: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix=thread_name)

    def submit(self, job_metadata: TransferJob, is_load: bool) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = [int(chunk) for chunk in job_metadata.chunk_ids]
        if len(chunk_ids) != len(keys):
            raise ValueError(f"job {job_metadata.job_id}: {len(keys)} keys but {len(chunk_ids)} chunk_ids")
        now = time.monotonic()
        job = _Job(
            job_id=job_metadata.job_id,
            keys=keys,
            object_keys=[self.object_key(key) for key in keys],
            pointers=[self.slots.chunk_pointer(chunk) for chunk in chunk_ids],
            seal_pointers=[self.slots.seal_pointer(chunk) for chunk in chunk_ids],
            chunk_ids=chunk_ids,
            is_load=is_load,
            deadline=now + self.timeout_s,
            submitted=now,
        )
        self.jobs[job.job_id] = job
        if isinstance(self.slots, EncryptedSlots):
            tenant = request_tenant(job_metadata.req_context)
            if tenant is None:
                self._refuse_without_tenant(job)
                return
            job.box = self.slots.box(tenant)
        if self.supervisor.state is not TierState.UP:  # fail at once: no I/O thread needed (all may be stalled)
            self.counters.count_failure(0.0, FailureReason.REFUSED)
            self._fail_unrun(job)
            return
        try:
            job.future = self._io.submit(self._run, job)
        except RuntimeError:  # shut down: the job fails like any other
            self._fail_unrun(job)

    def _refuse_without_tenant(self, job: _Job) -> None:
        """Fail an encrypting tier's job whose request names no tenant (a context vLLM's connector did not build:
        a peer's, a tool's): it is neither stored in the clear nor opened with a key guessed for it."""
        self.counters.count_failure(0.0, FailureReason.NO_TENANT)
        if not self._warned_no_tenant:
            self._warned_no_tenant = True
            logger.warning(
                "%s: %s job %d names no tenant (its request context does not carry the cache_salt kvtriton records "
                "on the contexts vLLM's connector builds): it fails, as every such job will (counted as no_tenant)",
                self.who,
                job.kind,
                job.job_id,
            )
        self._fail_unrun(job)

    def _fail_unrun(self, job: _Job) -> None:
        """Report ``job`` failed; it never reached the store."""
        job.failed = list(job.keys)
        job.phase = _Phase.DONE
        job.call_returned.set()
        self._finished.put(job)

    def _run(self, job: _Job) -> None:
        """One job on an I/O thread: a single batch call, every key's result checked.

        Reaches ``_finished`` unless the job was abandoned at its deadline (then
        it was reported already; a store is never abandoned while its call runs,
        see :meth:`_expire`)."""
        with self.lock:
            if job.phase is _Phase.ABANDONED:  # failed at its deadline while queued: never touched memory
                job.call_returned.set()
                return
            job.phase = _Phase.RUNNING
            self.in_flight[job.job_id] = job
        started = time.monotonic()
        try:
            self._transfer(job)
        except Exception:
            logger.exception("%s: job %d raised", self.who, job.job_id)
            job.failed = [key for key in job.keys if key not in set(job.succeeded)]
        finally:
            job.seconds = time.monotonic() - started
            with self.lock:
                abandoned = _abandoned(job)  # set by the scheduler thread meanwhile
                if not abandoned:
                    job.phase = _Phase.DONE
                self.in_flight.pop(job.job_id, None)
                late = abandoned or job.overdue
                if late:
                    self.counters.abandoned_calls -= 1
                job.call_returned.set()
            if late:
                logger.warning(
                    "%s: %s job %d returned from the store after %.1f s, %.1f s past its deadline; "
                    "its slots are free again",
                    self.who,
                    job.kind,
                    job.job_id,
                    time.monotonic() - job.submitted,
                    time.monotonic() - job.deadline,
                )
            if not abandoned:
                self._finished.put(job)

    def _transfer(self, job: _Job) -> None:
        store = self.supervisor.store
        if self.supervisor.state is not TierState.UP or store is None or time.monotonic() > job.deadline:
            job.failed = list(job.keys)  # not up, or queued past the deadline: fail without touching the network
            self.counters.count_failure(
                0.0, FailureReason.REFUSED if self.supervisor.state is not TierState.UP else FailureReason.DEADLINE
            )
            return
        slots = self.slots
        started = time.monotonic()
        # The job's own memory, when its values do not move straight between the primary and the store: a load's
        # landing rows, an encrypting store's sealed boxes (egress).
        own: np.ndarray | None = None
        landing: np.ndarray | None = None
        if job.is_load and not self.loads_into_primary:
            own = landing = np.empty((len(job.keys), slots.sealed_bytes), dtype=np.uint8)
            segments: list[list[Segment]] = slots.landing_segments(landing)
        elif not job.is_load and isinstance(slots, EncryptedSlots):
            if job.box is None:  # submit() names every encrypting job's box; never store one in the clear
                raise RuntimeError(f"store job {job.job_id} of an encrypting tier has no tenant's box")
            own = np.empty((len(job.keys), slots.sealed_bytes), dtype=np.uint8)
            slots.seal_into(job.box, job.keys, job.chunk_ids, own)
            segments = slots.row_segments(own)
        else:
            segments = slots.segments(job.pointers, job.seal_pointers)
        if own is not None and not store.register_memory(own.ctypes.data, own.nbytes):
            job.failed = list(job.keys)
            self.counters.count_failure(0.0, FailureReason.ERROR)
            return
        try:
            if job.is_load:
                results = store.get(job.object_keys, segments)
            else:
                if own is None:
                    for key, chunk in zip(job.keys, job.chunk_ids):
                        slots.seal(key, chunk)
                results = store.put(job.object_keys, segments)
        finally:
            if own is not None:
                store.unregister_memory(own.ctypes.data)
        seconds = time.monotonic() - started
        with self.lock:
            if job.phase is _Phase.ABANDONED:
                return  # reported failed at its deadline: what the call wrote stays in memory vLLM keeps aside
            job.phase = _Phase.LANDING
            overdue = job.overdue
        self._land(job, store, results, landing, seconds, overdue)

    def _land(
        self,
        job: _Job,
        store: RemoteClient,
        results: list[Outcome] | list[int | Outcome],
        landing: np.ndarray | None,
        seconds: float,
        overdue: bool,
    ) -> None:
        """Check every key's result of a call that returned, count them, and log the keys that failed."""
        answers: list[int | Outcome] = list(results)
        if len(answers) != len(job.keys):
            answers = [Outcome.FAILED] * len(job.keys)
        wrong_size = 0
        faults = 0
        for index, (key, object_key, chunk, result) in enumerate(
            zip(job.keys, job.object_keys, job.chunk_ids, answers)
        ):
            if not job.is_load:
                (job.succeeded if result is Outcome.OK and not overdue else job.failed).append(key)
                continue
            checked = self.slots.check_load(
                store, key, object_key, chunk, result, None if landing is None else landing[index], job.box
            )
            (job.succeeded if checked.loaded else job.failed).append(key)
            wrong_size += checked.wrong_size
            faults += checked.fault is not None
        lost_store = any(result is Outcome.UNREACHABLE for result in answers)
        chunk_bytes = self.slots.chunk_bytes
        with self.lock:
            counters = self.counters
            counters.slowest_op_seconds = max(counters.slowest_op_seconds, seconds)
            if job.failed and not overdue:  # an overdue store was counted at its deadline
                counters.failed_ops += 1
                counters.failed_op_seconds += seconds
                counters.failures[FailureReason.UNREACHABLE if lost_store else FailureReason.ERROR] += 1
            if job.is_load:
                counters.loaded_keys += len(job.succeeded)
                counters.load_failed_keys += len(job.failed)
                counters.wrong_size_keys += wrong_size
                counters.integrity_failures += faults
                counters.bytes_loaded += len(job.succeeded) * chunk_bytes
            else:
                counters.stored_keys += len(job.succeeded)
                counters.store_failed_keys += len(job.failed)
                counters.bytes_stored += len(job.succeeded) * chunk_bytes
        if job.failed and not overdue:
            failed_results = sorted(
                {_describe(result) for result, key in zip(answers, job.keys) if key in set(job.failed)}
            )
            logger.info(
                "%s: %s job %d: %d of %d keys failed (%s)",
                self.who,
                job.kind,
                job.job_id,
                len(job.failed),
                len(job.keys),
                ", ".join(failed_results),
            )
        if lost_store:
            self.supervisor.set_down()

    def _expire(self, job: _Job, now: float) -> JobResult | None:
        """The deadline of ``job`` has passed: its failure, when it can be reported now (scheduler thread).

        A queued job fails at once (it never touched memory). A running load is
        abandoned: reported failed now, its slots kept aside until the call
        returns (vLLM 0.34's ``deferred_release``; on 0.33 the call writes only
        the job's own landing memory). A running store stays unreported until
        its call returns, then fails: its slots stay pinned by vLLM's read count
        meanwhile, as vLLM has no way to keep a store's slots aside, and no
        request waits on a cascade. Either way the failure is counted now and
        the tier degrades.
        """
        with self.lock:
            if job.overdue or job.phase not in (_Phase.QUEUED, _Phase.RUNNING):
                return None
            started = job.phase is _Phase.RUNNING
            if started:
                job.overdue = True
                self.counters.abandoned_calls += 1
            if not started or job.is_load:
                job.phase = _Phase.ABANDONED
            counters = self.counters
            counters.failed_ops += 1
            counters.failed_op_seconds += now - job.submitted
            counters.failures[FailureReason.DEADLINE] += 1
            if job.is_load:
                counters.load_failed_keys += len(job.keys)
        self.supervisor.degrade(f"{job.kind} job {job.job_id} {'running' if started else 'queued'}")
        if job.phase is not _Phase.ABANDONED:
            return None  # a running store: reported when its call returns
        self.jobs.pop(job.job_id, None)
        if job.is_load:
            self.lookups.mark_miss(job.keys)
        if started and self.loads_into_primary:
            return failed_load_result(job.job_id, None, now - job.submitted, 0, job.call_returned)
        return JobResult(job.job_id, False, None, now - job.submitted, 0)

    def finished(self) -> Iterable[JobResult]:
        """The jobs that completed since the last call, and those whose deadline passed (scheduler thread)."""
        results: list[JobResult] = []
        while True:
            try:
                job = self._finished.get_nowait()
            except queue.Empty:
                break
            if self.jobs.pop(job.job_id, None) is None:
                continue
            moved = len(job.succeeded) * self.slots.chunk_bytes
            loaded_some: tuple[OffloadKey, ...] | None = None  # a partly failed load reports the keys it loaded
            if job.failed and job.is_load:
                self.lookups.mark_miss(job.failed)
                loaded_some = tuple(job.succeeded) or None
            elif job.succeeded and not job.is_load:
                mark_stored(self.lookups, job.succeeded)  # a MISS cached before the put gives way (vLLM 0.34)
            results.append(JobResult(job.job_id, not job.failed, loaded_some, job.seconds, moved))
        now = time.monotonic()
        for job in [job for job in self.jobs.values() if now > job.deadline and not job.overdue]:
            expired = self._expire(job, now)
            if expired is not None:
                results.append(expired)
        return results

    def wait_for_calls(self, bound_s: float | None) -> bool:
        """Wait until no store call of any job (abandoned ones included) can touch memory; False when ``bound_s``
        passed first. Unbounded, it logs a WARNING every ``timeout_s`` it keeps waiting."""
        deadline = None if bound_s is None else time.monotonic() + bound_s
        while True:
            with self.lock:
                running = list(self.in_flight.values())
            if not running:
                return True
            wait_s = self.timeout_s
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    return False
            if not running[0].call_returned.wait(wait_s) and bound_s is None:
                logger.warning(
                    "%s: waiting for %d call(s) still inside the store (job %s) before the primary's slots can be "
                    "reused",
                    self.who,
                    len(running),
                    ", ".join(str(job.job_id) for job in running),
                )

    def cancel_queued(self) -> None:
        """Fail every job no I/O thread has started."""
        for job in list(self.jobs.values()):
            future = job.future
            if future is not None and future.cancel():
                self._fail_unrun(job)

    def shutdown(self) -> None:
        """No more jobs run (queued ones are cancelled); the threads inside calls finish them."""
        self._io.shutdown(wait=False, cancel_futures=True)


def _abandoned(job: _Job) -> bool:
    """Whether the scheduler thread abandoned ``job`` (a call, so that the type checker does not assume the phase
    this thread set last)."""
    return job.phase is _Phase.ABANDONED


def _describe(result: int | Outcome) -> str:
    """One key's result in a log line: the size a get moved, or the outcome."""
    return f"{result} bytes" if isinstance(result, int) else result.value
