"""TransferEngine: asynchronous store (GPU -> slab) and load (slab -> GPU) jobs.

The worker-side counterpart of vLLM's CPU<->GPU offloading handlers. A job is
submitted with the specs the scheduler side produced, planned into host
indices (:mod:`kvtriton.worker._plan`, which also validates them, vectorised),
copied by one backend call (:mod:`kvtriton.worker._backends`) and reported
once by :meth:`get_finished`, in submission order per lane.

Built once per engine: the backend choice per direction, the backend itself
(for Triton: launch configuration, page table on the device, slab view), the
streams, and the warm-up that compiles every kernel variant a job can ask
for (``warmup_seconds``). Per job the host only plans, stages the indices,
launches and records an event.

Lanes and streams (CUDA): stores, loads and expedited loads each have a
stream of their own, created for this engine (``torch.cuda.Stream()`` would
hand out pool streams shared round-robin with every other ``Stream()`` in the
process, vLLM's included, and a lane would then queue behind unrelated
work); the expedited one has the device's highest priority and its own
queue, so an expedited load never waits behind ordinary loads. Lanes are not
ordered against each other: a load of a slot whose store is still in flight
reads whatever the slot held (vLLM's manager never issues one). Every job first waits for
the work already queued on the compute stream (the calling thread's current
stream at ``submit_*``), through one pooled event per lane: a store reads pages
the model just wrote, a load overwrites blocks that queued work may still read
or zero. tests/worker/test_engine_stream_order.py checks that order on a CPU.
Indices are staged in pooled pinned buffers (the smallest free one that fits)
and copied with ``non_blocking=True`` into pooled device buffers that only
their lane's stream uses; only the used part is copied. Block and row ids
both start on 16-byte boundaries, so the kernel sees one alignment and never
needs a second variant. Submitting never synchronises the device. Pooled CUDA
events mark completion and time each job. A job that cannot be staged (out of
memory, say) is refused (``submit_*`` returns False) and leaks nothing.

Refused at submit, besides invalid specs: jobs after :meth:`TransferEngine.shutdown`,
jobs on a closed slab (the memory may be unpinned or gone), and jobs
submitted while the current CUDA stream is capturing a graph (a captured
launch would replay with the indices of that one job forever).

Threads: the engine is driven from one thread (vLLM's worker calls it from
its own); ``submit_*``, ``get_finished`` and ``wait`` are not safe to call
concurrently.

A pageable slab (``HostSlab(..., allow_pageable=True)`` after a failed pin):
copies to or from pageable memory block the calling thread until the
stream is ready, so such jobs run on one worker thread per lane; ``submit_*``
returns at once and never waits for the forward pass.

Compression (``kv_compression="fp8-e4m3"``, lossy, off by default): rows
hold fp8 codes and scales (``PagedKV.compression``), ``transfer_size``
counts the compressed bytes. A store whose pages hold NaN or infinity writes
the NaN code there (a row loaded back reads NaN, never a finite number),
succeeds, and is counted: :attr:`TransferEngine.stats` (``non_finite_stores``)
and a WARNING at most every :data:`NON_FINITE_WARNING_INTERVAL_S` seconds.
Failing the job instead would stop a vLLM server (its worker asserts that
every store succeeds). The kernel flags the event in the job's pinned status
word, read once the job has finished (no sync).

On CPU the copy runs inside ``submit_*`` and the job is reported by the next
``get_finished``. All paths share planning, validation, ordering and
reporting; only the :class:`_Completion` differs.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from numpy.typing import NDArray

from kvtriton._int_argument import check_int
from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from kvtriton.kernels import DEFAULT_NUM_PROGRAMS, KVCompression
from kvtriton.worker._backends import CopyBackend, DeviceIndices, TransferBackend, choose_backend, make_backend
from kvtriton.worker._closing import ClosesOnExit
from kvtriton.worker._cudart import create_stream, destroy_stream, loaded_cudart, stream_priority_range
from kvtriton.worker._layout import PagedKV
from kvtriton.worker._plan import TransferDirection, TransferPlan, plan_transfer
from kvtriton.worker._slab import HostSlab

logger = logging.getLogger(__name__)

NON_FINITE_WARNING_INTERVAL_S = 60.0
"""At most one WARNING per this many seconds about stores that met NaN or infinity (each one is counted)."""


class TransferLane(enum.Enum):
    """One ordered queue of jobs with its own CUDA stream.

    Expedited loads (vLLM's ``expedited=True``: the scheduler waits for them
    within the step) have a lane of their own, on a high-priority stream, so
    that they never queue behind ordinary loads submitted earlier.
    """

    STORE = "store"
    LOAD = "load"
    EXPEDITED_LOAD = "expedited load"

    @property
    def direction(self) -> TransferDirection:
        return TransferDirection.STORE if self is TransferLane.STORE else TransferDirection.LOAD


@dataclass(frozen=True, slots=True)
class TransferResult:
    """How one job ended, as vLLM's ``TransferResult`` reports it.

    ``transfer_size`` is in bytes (rows moved x row bytes), ``transfer_time``
    in seconds, ``transfer_type`` is ``(source medium, destination medium)``:
    ``("GPU", "CPU")`` for a store, ``("CPU", "GPU")`` for a load.
    """

    job_id: int
    success: bool
    transfer_size: int
    transfer_time: float
    transfer_type: tuple[str, str]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters of one engine since it was built (:attr:`TransferEngine.stats` takes a snapshot)."""

    non_finite_stores: int = 0
    """Compressed stores whose pages held NaN or infinity: they succeeded, and their rows hold NaN codes there."""


class _Completion(Protocol):
    """When a job's copy is done, whether it succeeded and how long it took."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...

    def succeeded(self) -> bool: ...

    def seconds(self) -> float: ...


@dataclass(frozen=True, slots=True)
class _Finished:
    """A copy that already ran on the host (CPU path, empty job, or a job that failed before reaching the GPU)."""

    success: bool
    elapsed: float

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def succeeded(self) -> bool:
        return self.success

    def seconds(self) -> float:
        return self.elapsed


@dataclass(frozen=True, slots=True)
class _EventPair:
    """Two timing events around one job on a stream; pooled, reused once the job is reported."""

    start: torch.cuda.Event
    end: torch.cuda.Event


@dataclass(frozen=True, slots=True)
class _Events:
    """A copy enqueued on a CUDA stream between two timing events."""

    events: _EventPair
    success: bool

    def done(self) -> bool:
        return self.events.end.query()

    def wait(self) -> None:
        self.events.end.synchronize()

    def succeeded(self) -> bool:
        return self.success

    def seconds(self) -> float:
        return self.events.start.elapsed_time(self.events.end) / 1e3


@dataclass(frozen=True, slots=True)
class _Threaded:
    """A copy to or from a pageable slab, issued by the lane's worker thread, then timed by events."""

    future: Future[bool]
    events: _EventPair

    def done(self) -> bool:
        return self.future.done() and self.events.end.query()

    def wait(self) -> None:
        self.future.result()
        self.events.end.synchronize()

    def succeeded(self) -> bool:
        return self.future.result()

    def seconds(self) -> float:
        return self.events.start.elapsed_time(self.events.end) / 1e3


MIN_STAGING_PAIRS = 64
"""Smallest index staging buffer, in pairs; larger jobs get the next power of two."""


class _Staging:
    """One job's index buffers: host (pinned on CUDA) and device, reused once the job is reported.

    A job of ``count`` pairs puts its blocks at ``[0, count)`` and its rows
    right after, from the next even index (``staged_rows_at``): both start on
    a 16-byte boundary (allocations start 512-byte aligned), so every job
    presents the kernel with the same alignment, and the used part is one
    contiguous prefix, copied to the device in one call.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        cuda = device.type == "cuda"
        self.host = torch.empty(2 * capacity, dtype=torch.int64, pin_memory=cuda)
        self.host_numpy: NDArray[np.int64] = self.host.numpy()
        self.device = torch.empty(2 * capacity, dtype=torch.int64, device=device) if cuda else self.host
        # A compressed store's "met NaN or infinity" flag: pinned host memory the kernel writes through its
        # device mapping, read by the host once the job's event has fired (no sync, no copy back).
        self.status = torch.zeros(4, dtype=torch.int32, pin_memory=cuda)
        self._views: dict[int, tuple[DeviceIndices, torch.Tensor, torch.Tensor]] = {}
        """Per pair count: the job's indices and the host and device prefixes the CUDA copy moves. Slicing a
        tensor costs about a microsecond, and jobs repeat a few counts (a full chunk, mostly)."""

    def met_non_finite(self) -> bool:
        """Whether the job staged here last (finished) met NaN or infinity in a compressed store."""
        return int(self.status[0]) != 0

    def stage(self, plan: TransferPlan, *, clear_status: bool = True) -> DeviceIndices:
        """Put ``plan``'s indices where the kernel reads them; ``clear_status`` for a job whose kernel may flag
        NaN or infinity in :attr:`status` (a compressed store), the only ones whose status is read back."""
        count = plan.num_rows
        rows_at = staged_rows_at(count)
        self.host_numpy[:count] = plan.gpu_blocks
        self.host_numpy[rows_at : rows_at + count] = plan.slab_rows
        if clear_status:
            self.status.zero_()  # free staging: no kernel reads or writes it now
        views = self._views.get(count)
        if views is None:
            used = rows_at + count
            indices = DeviceIndices(self.device[:count], self.device[rows_at : rows_at + count], self.status)
            views = self._views[count] = (indices, self.host[:used], self.device[:used])
        indices, host_used, device_used = views
        if self.device is not self.host:
            device_used.copy_(host_used, non_blocking=True)
        return indices


def staged_rows_at(count: int) -> int:
    """Where a job of ``count`` pairs stages its rows: the first even index after its blocks (16-byte aligned)."""
    return count + (count & 1)


def _staging_capacity(count: int) -> int:
    return max(MIN_STAGING_PAIRS, 1 << (count - 1).bit_length())


def _graph_capture_underway() -> bool:
    """Whether the current CUDA stream is capturing a graph (False before CUDA is initialised: nothing can be)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _lane_stream(device: torch.device, lane: TransferLane) -> tuple[torch.cuda.Stream, int | None]:
    """A stream used by this lane alone, and its handle to destroy (None when it came from torch's pool).

    Expedited loads get the device's most urgent priority, the other lanes the default one.
    """
    urgent = lane is TransferLane.EXPEDITED_LOAD
    if loaded_cudart() is None:
        logger.warning(
            "libcudart is not loaded in this process: the %s lane takes a stream from torch's pool, which other "
            "streams of the process may share",
            lane.value,
        )
        return torch.cuda.Stream(device, priority=-1 if urgent else 0), None
    with torch.cuda.device(device):
        least, greatest = stream_priority_range()
        handle = create_stream(greatest if urgent else least)
    return torch.cuda.ExternalStream(handle, device=device), handle


@dataclass(slots=True)
class _Job:
    job_id: int
    lane: TransferLane
    size: int
    completion: _Completion
    staging: _Staging | None = None


class TransferEngine(ClosesOnExit):
    """Runs store and load jobs between ``kv``'s GPU pages and ``slab``'s rows.

    ``backend`` is ``"auto"``, ``"triton"``, ``"dma"`` or ``"torch"``; the
    choice is made here, once per direction (see
    :mod:`kvtriton.worker._backends`), and :attr:`backends` reports what runs.
    ``num_programs`` caps the Triton grid. The slab's ``block_size_factor`` is
    the engine's: one slot holds that many GPU blocks. Building the engine
    warms up every kernel variant a job can need (:attr:`warmup_seconds`).

    The engine holds the slab and registers itself as its user, so closing
    the slab first drains this engine's streams; :meth:`close` (or
    :meth:`shutdown`) drains them too, and so does garbage collection.

    ``kv_compression`` (``"none"`` or ``"fp8-e4m3"``; None: ``kv.compression``)
    re-describes ``kv`` with that compression (:attr:`kv` is the result): the
    slab's rows must then hold ``kv.with_compression(...).row_bytes``.
    """

    def __init__(
        self,
        kv: PagedKV,
        slab: HostSlab,
        backend: str | TransferBackend = "auto",
        *,
        num_programs: int = DEFAULT_NUM_PROGRAMS,
        kv_compression: str | KVCompression | None = None,
    ) -> None:
        if not isinstance(kv, PagedKV):  # pyright: ignore[reportUnnecessaryIsInstance] -- catch raw tensors passed by mistake
            raise TypeError(f"kv must be a PagedKV (see PagedKV.from_tensors), got {type(kv).__name__}")
        if not isinstance(slab, HostSlab):  # pyright: ignore[reportUnnecessaryIsInstance] -- same
            raise TypeError(f"slab must be a HostSlab, got {type(slab).__name__}")
        parsed = TransferBackend.parse(backend)
        check_int("num_programs", num_programs, minimum=1)
        if kv.device.type not in ("cpu", "cuda"):
            raise ValueError(f"kv must live on a CUDA device or the CPU, got {kv.device}")
        if kv_compression is not None:
            kv = kv.with_compression(KVCompression.parse(kv_compression, "kv_compression"))
        if slab.closed:
            raise ValueError("slab is closed")
        if slab.row_bytes < kv.row_bytes:
            compressed = "" if kv.compression is KVCompression.NONE else f", compressed with {kv.compression.value}"
            raise ValueError(
                f"slab rows hold {slab.row_bytes} bytes but one block of kv needs {kv.row_bytes} "
                f"(page bytes {kv.page_bytes}{compressed}); build the slab with row_bytes=kv.row_bytes"
            )
        self.kv = kv
        self.slab = slab
        self.block_size_factor = slab.block_size_factor
        self._cuda = kv.device.type == "cuda"
        # Copies to or from pageable memory block the issuing thread: they get worker threads.
        self._threaded = self._cuda and not slab.pinned
        chosen = {
            direction: choose_backend(
                parsed,
                direction,
                device=kv.device,
                slab_pinned=slab.pinned,
                page_bytes=min(kv.page_bytes),
                slab_device_aliased=slab.device_aliased,
                compressed=kv.compression_layout is not None,
            )
            for direction in TransferDirection
        }
        built: dict[TransferBackend, CopyBackend] = {}
        for kind in chosen.values():
            if kind not in built:
                built[kind] = make_backend(
                    kind,
                    kv,
                    slab.rows,
                    num_programs=num_programs,
                    registration_rows=slab.registration_rows,
                    slab_pinned=slab.pinned,
                )
        self._backends: dict[TransferDirection, CopyBackend] = {
            direction: built[kind] for direction, kind in chosen.items()
        }
        self._streams: dict[TransferLane, torch.cuda.Stream] = {}
        self._stream_handles: list[int] = []
        self._workers: dict[TransferLane, ThreadPoolExecutor] = {}
        if self._cuda:
            for lane in TransferLane:
                self._streams[lane], handle = _lane_stream(kv.device, lane)
                if handle is not None:
                    self._stream_handles.append(handle)
        if self._threaded:
            self._workers = {
                lane: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvtriton-{lane.name.lower()}")
                for lane in TransferLane
            }
        self._queues: dict[TransferLane, deque[_Job]] = {lane: deque() for lane in TransferLane}
        self._free_staging: dict[TransferLane, list[_Staging]] = {lane: [] for lane in TransferLane}
        self._free_events: list[_EventPair] = []
        self._compute_marks: dict[TransferLane, torch.cuda.Event] = {}
        self._unreported: set[int] = set()
        self._closed = False
        self._non_finite_stores = 0
        self._non_finite_unwarned = 0
        self._non_finite_warned_at: float | None = None
        self.warmup_seconds = self._warm_up(list(built.values()))
        slab.add_user(self)
        logger.info(
            "transfer engine: %d page tensors, %d-byte rows (compression %s), %d slots x %d rows, backend %s on %s, "
            "warm-up %.3f s",
            len(kv.pages),
            kv.row_bytes,
            kv.compression.value,
            slab.num_slots,
            slab.block_size_factor,
            self.backend_name,
            kv.device,
            self.warmup_seconds,
        )

    def _warm_up(self, backends: list[CopyBackend]) -> float:
        """Compile every variant a job can need, now rather than on a live server's first job; the seconds it took."""
        started = time.perf_counter()
        for backend in backends:
            backend.warm_up()
        if self._cuda:
            torch.cuda.synchronize(self.kv.device)
        return time.perf_counter() - started

    @property
    def backend_name(self) -> str:
        """What runs, for people: ``"triton"``, or ``"triton (store) / dma (load)"`` when the directions differ.

        On CUDA the ``dma`` and ``torch`` backends add how a job reaches the
        copy engines: ``"dma [cudaMemcpyBatchAsync per job]"`` (CUDA 12.8 and
        later, pinned slab) or ``"dma [cudaMemcpy2DAsync per run]"``.
        """
        store, load = (self._describe(self._backends[direction]) for direction in TransferDirection)
        return store if store == load else f"{store} (store) / {load} (load)"

    @staticmethod
    def _describe(backend: CopyBackend) -> str:
        return backend.kind.value + (f" [{backend.submission}]" if backend.submission else "")

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (``non_finite_stores``: see the module docstring)."""
        return EngineStats(non_finite_stores=self._non_finite_stores)

    @property
    def backends(self) -> dict[TransferDirection, TransferBackend]:
        """The backend that really copies each direction's jobs (``auto`` resolved)."""
        return {direction: backend.kind for direction, backend in self._backends.items()}

    @property
    def backend(self) -> TransferBackend:
        """The backend in use when both directions use the same one; see :attr:`backends` otherwise."""
        store, load = (self._backends[direction].kind for direction in TransferDirection)
        if store is not load:
            raise ValueError(f"stores run {store.value} and loads run {load.value}; read engine.backends")
        return store

    def stream(self, lane: TransferLane) -> torch.cuda.Stream:
        """The CUDA stream ``lane``'s jobs run on (``ValueError`` on a CPU engine, which has none)."""
        if not self._cuda:
            raise ValueError(f"a CPU engine runs jobs inside submit_*; it has no {lane.value} stream")
        if lane not in self._streams:
            raise ValueError(f"the engine is shut down: its {lane.value} stream was released")
        return self._streams[lane]

    @property
    def closed(self) -> bool:
        """True once :meth:`close` or :meth:`shutdown` ran: new jobs are refused."""
        return self._closed

    def submit_store(self, job_id: int, src: GPULoadStoreSpec, dst: LoadStoreSpec) -> bool:
        """Start copying GPU blocks ``src`` into slots ``dst``; False (nothing reported) if the job is invalid.

        ``dst`` is typed as vLLM types it (the manager's ``store_spec``); it
        must be a :class:`CPULoadStoreSpec` at runtime.
        """
        return self._submit(job_id, TransferLane.STORE, src, dst)

    def submit_load(self, job_id: int, src: LoadStoreSpec, dst: GPULoadStoreSpec, expedited: bool = False) -> bool:
        """Start copying slots ``src`` (a :class:`CPULoadStoreSpec`) into GPU blocks ``dst``; False if invalid.

        ``expedited=True`` (vLLM's name: a load the scheduler waits for within
        the step) runs it on its own high-priority stream, never behind the
        ordinary loads submitted before it.
        """
        return self._submit(job_id, TransferLane.EXPEDITED_LOAD if expedited else TransferLane.LOAD, dst, src)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, each exactly once, in submission order per lane."""
        results: list[TransferResult] = []
        for lane, queue in self._queues.items():
            while queue and queue[0].completion.done():
                job = queue.popleft()
                self._unreported.discard(job.job_id)
                success = job.completion.succeeded()
                if success and job.staging is not None:
                    self._count_non_finite(job.job_id, lane, job.staging)
                results.append(
                    TransferResult(
                        job_id=job.job_id,
                        success=success,
                        transfer_size=job.size if success else 0,
                        transfer_time=job.completion.seconds(),
                        transfer_type=lane.direction.transfer_type,
                    )
                )
                self._recycle(job)
        return results

    def _flags_non_finite(self, lane: TransferLane) -> bool:
        """Whether ``lane``'s kernel flags NaN or infinity in its staging's status: compressed stores alone."""
        return lane is TransferLane.STORE and self.kv.compression_layout is not None

    def _count_non_finite(self, job_id: int, lane: TransferLane, staging: _Staging) -> None:
        """Count a finished compressed store that met NaN or infinity; warn at most once per interval."""
        if not self._flags_non_finite(lane) or not staging.met_non_finite():
            return
        self._non_finite_stores += 1
        self._non_finite_unwarned += 1
        now = time.monotonic()
        if self._non_finite_warned_at is not None and now - self._non_finite_warned_at < NON_FINITE_WARNING_INTERVAL_S:
            return
        logger.warning(
            "%d store job(s) (the last: job %d) met NaN or infinity in the GPU pages; kv_compression='%s' stored "
            "the NaN code there, so those blocks load back as NaN (%d such stores since the engine started; "
            "next warning in %.0f s at the earliest)",
            self._non_finite_unwarned,
            job_id,
            self.kv.compression.value,
            self._non_finite_stores,
            NON_FINITE_WARNING_INTERVAL_S,
        )
        self._non_finite_unwarned = 0
        self._non_finite_warned_at = now

    def _recycle(self, job: _Job) -> None:
        """Return a reported job's staging buffers and events to the pools (its copy has finished)."""
        if job.staging is not None:
            self._free_staging[job.lane].append(job.staging)
        completion = job.completion
        if isinstance(completion, (_Events, _Threaded)):
            self._free_events.append(completion.events)

    def wait(self, job_ids: set[int]) -> None:
        """Block until the named jobs have finished (ids not in flight are ignored); they stay reportable."""
        for queue in self._queues.values():
            for job in queue:
                if job.job_id in job_ids:
                    job.completion.wait()

    def drain(self) -> None:
        """Block until nothing queued by this engine touches the slab or the pages any more."""
        for queue in self._queues.values():
            for job in queue:
                job.completion.wait()
        for stream in self._streams.values():
            stream.synchronize()

    def shutdown(self) -> None:
        """Drain every job in flight and refuse new ones; results stay available to get_finished. Idempotent."""
        self.drain()
        for worker in self._workers.values():
            worker.shutdown(wait=True)
        self._closed = True
        self._destroy_streams()

    def _destroy_streams(self) -> None:
        """Release the lanes' own streams (drained already; their recorded events stay queryable).

        The stream objects go too: a later :meth:`drain` (the slab's close, say) has none left to synchronise.
        """
        handles, self._stream_handles = self._stream_handles, []
        self._streams = {}
        for handle in handles:
            destroy_stream(handle)

    def close(self) -> None:
        """Same as :meth:`shutdown` (the slab is closed by its owner, after this)."""
        self.shutdown()

    def __del__(self) -> None:
        # A forgotten engine must not let the slab's memory go (unpinned or
        # unmapped) under copies still queued on its streams.
        try:
            self.drain()
            self._destroy_streams()
        except Exception:  # noqa: BLE001 -- interpreter shutdown may have torn down CUDA already
            pass

    def _submit(self, job_id: int, lane: TransferLane, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec) -> bool:
        name = lane.value
        if self._closed:
            logger.warning("%s job %r refused: the engine is shut down", name, job_id)
            return False
        if self.slab.closed:
            logger.warning(
                "%s job %r refused: the host slab is closed (its memory may be unpinned or unmapped); "
                "shut the engine down before closing its slab",
                name,
                job_id,
            )
            return False
        if _graph_capture_underway():
            logger.warning(
                "%s job %r refused: the current CUDA stream is capturing a graph; a captured copy would replay "
                "this job's indices on every replay (submit transfers outside graph capture)",
                name,
                job_id,
            )
            return False
        if isinstance(job_id, bool) or not isinstance(job_id, int):  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers
            logger.warning("%s job %r refused: job_id must be an int", name, job_id)
            return False
        if job_id in self._unreported:
            logger.warning("%s job %d refused: job id %d is still in flight or unreported", name, job_id, job_id)
            return False
        if not isinstance(cpu, CPULoadStoreSpec):
            logger.warning(
                "%s job %d refused: the slot spec is a %s, not a CPULoadStoreSpec", name, job_id, type(cpu).__name__
            )
            return False
        try:
            plan = plan_transfer(
                lane.direction,
                gpu,
                cpu,
                self.block_size_factor,
                num_gpu_blocks=self.kv.num_blocks,
                num_slots=self.slab.num_slots,
            )
        except (TypeError, ValueError) as error:
            logger.warning("%s job %d refused: %s", name, job_id, error)
            return False
        if plan.num_rows == 0:
            # Nothing to move: done at once, on every backend and device, without touching a kernel or a stream.
            job = _Job(job_id, lane, 0, _Finished(True, 0.0))
        else:
            try:
                if self._threaded:
                    job = self._launch_threaded(job_id, lane, plan)
                elif self._cuda:
                    job = self._launch_cuda(job_id, lane, plan)
                else:
                    job = self._run_now(job_id, lane, plan)
            except Exception as error:  # noqa: BLE001 -- staging: out of (pinned or device) memory, say; nothing was queued
                logger.warning("%s job %d refused: its indices could not be staged: %s", name, job_id, error)
                return False
        self._queues[lane].append(job)
        self._unreported.add(job_id)
        return True

    def _copy(self, job_id: int, lane: TransferLane, plan: TransferPlan, device: DeviceIndices | None) -> bool:
        """Run the direction's backend; a raising copy fails only this job."""
        backend = self._backends[plan.direction]
        try:
            backend.copy(plan, device)
        except Exception:
            logger.exception("%s job %d failed in the %s backend", lane.value, job_id, backend.kind.value)
            return False
        return True

    def _take_staging(self, lane: TransferLane, count: int) -> _Staging:
        """The smallest free staging buffer of ``lane`` that holds ``count`` pairs, or a new one."""
        free = self._free_staging[lane]
        best: int | None = None
        for index, staging in enumerate(free):
            if staging.capacity >= count and (best is None or staging.capacity < free[best].capacity):
                best = index
        if best is not None:
            return free.pop(best)
        return _Staging(_staging_capacity(count), self.kv.device)

    def _take_events(self) -> _EventPair:
        if self._free_events:
            return self._free_events.pop()
        return _EventPair(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def _run_now(self, job_id: int, lane: TransferLane, plan: TransferPlan) -> _Job:
        started = time.perf_counter()
        backend = self._backends[plan.direction]
        staging = self._take_staging(lane, plan.num_rows) if backend.wants_device_indices else None
        device = staging.stage(plan, clear_status=self._flags_non_finite(lane)) if staging is not None else None
        success = self._copy(job_id, lane, plan, device)
        if staging is not None:
            if success:
                self._count_non_finite(job_id, lane, staging)
            self._free_staging[lane].append(staging)  # the copy already ran: reusable at once
        completion = _Finished(success, time.perf_counter() - started)
        return _Job(job_id, lane, plan.num_rows * self.kv.row_bytes, completion)

    def _launch_cuda(self, job_id: int, lane: TransferLane, plan: TransferPlan) -> _Job:
        stream = self._streams[lane]
        # The submitting thread's current stream, where the model's work is queued: read here, outside the
        # lane's context (inside it the current stream is the lane itself, and waiting on that orders nothing).
        compute = torch.cuda.current_stream(self.kv.device)
        staging: _Staging | None = None
        with torch.cuda.stream(stream):
            if self._backends[plan.direction].wants_device_indices:
                # Taken (and, when new, allocated) on this lane's stream: only this stream ever uses it.
                # Before anything is queued: a failed allocation refuses the job and leaks nothing.
                staging = self._take_staging(lane, plan.num_rows)
            events = self._take_events()
            self._follow_compute(lane, compute)
            events.start.record(stream)
            device = staging.stage(plan, clear_status=self._flags_non_finite(lane)) if staging is not None else None
            success = self._copy(job_id, lane, plan, device)
            events.end.record(stream)
        return _Job(job_id, lane, plan.num_rows * self.kv.row_bytes, _Events(events, success), staging)

    def _follow_compute(self, lane: TransferLane, compute: torch.cuda.Stream) -> None:
        """Start ``lane``'s next work after everything queued on ``compute`` so far.

        Every lane starts after the work already queued on the compute stream:
        a store reads pages the model just wrote; a load overwrites blocks that
        earlier steps may still read or zero (with async scheduling nothing
        else orders them; vLLM's handler waits likewise). One event per lane,
        made at its first job and recorded again for every job: a stream waits
        for the event as it was recorded when ``wait_event`` is called, so the
        next job's record leaves this wait as it is (``wait_stream`` would
        make a new event per job).
        """
        mark = self._compute_marks.get(lane)
        if mark is None:
            mark = self._compute_marks[lane] = torch.cuda.Event()
        mark.record(compute)
        self._streams[lane].wait_event(mark)

    def _launch_threaded(self, job_id: int, lane: TransferLane, plan: TransferPlan) -> _Job:
        stream = self._streams[lane]
        staging: _Staging | None = None
        if self._backends[plan.direction].wants_device_indices:
            with torch.cuda.stream(stream):
                staging = self._take_staging(lane, plan.num_rows)
        events = self._take_events()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.kv.device))

        def run() -> bool:
            try:
                with torch.cuda.device(self.kv.device), torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    events.start.record(stream)
                    device = (
                        staging.stage(plan, clear_status=self._flags_non_finite(lane)) if staging is not None else None
                    )
                    success = self._copy(job_id, lane, plan, device)
                    events.end.record(stream)
                return success
            except Exception:
                logger.exception("%s job %d failed on its worker thread", lane.value, job_id)
                return False

        future = self._workers[lane].submit(run)
        return _Job(job_id, lane, plan.num_rows * self.kv.row_bytes, _Threaded(future, events), staging)
