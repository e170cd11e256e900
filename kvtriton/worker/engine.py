"""TransferEngine: asynchronous store (GPU -> slab) and load (slab -> GPU) jobs.

The worker-side counterpart of vLLM's CPU<->GPU offloading handlers. A job is
submitted with the specs the scheduler side produced, planned into launch
indices (:mod:`kvtriton.worker.plan`), copied by one backend call
(:mod:`kvtriton.worker.backends`) and reported once by :meth:`get_finished`, in
submission order per direction.

On CUDA each direction has its own stream, so stores and loads overlap with
each other and with the model. Every job first waits for the work already
queued on the compute stream: a store reads pages the model just wrote, a
load overwrites blocks that queued work may still read or zero. Index tensors
are staged in pinned memory and copied with ``non_blocking=True``: submitting
never synchronises the device. CUDA events mark completion and time each job.

On CPU the copy runs inside ``submit_*`` and the job is reported by the next
``get_finished``. Both paths share the planning, validation, ordering and
reporting code; only :class:`_Completion` differs.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

import torch

from kvtriton.worker.backends import CopyBackend, TransferBackend, make_backend
from kvtriton.kernels import DEFAULT_NUM_PROGRAMS
from kvtriton.worker.layout import PagedKV
from kvtriton.worker.plan import TransferDirection, TransferPlan, plan_transfer
from kvtriton.worker.slab import HostSlab
from kvtriton.specs import CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec

__all__ = ["TransferEngine", "TransferLane", "TransferResult"]

logger = logging.getLogger(__name__)


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


class _Completion(Protocol):
    """When a job's copy is done and how long it took."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...

    def seconds(self) -> float: ...


@dataclass(frozen=True, slots=True)
class _Finished:
    """A copy that already ran on the host (CPU path, or a job that failed before reaching the GPU)."""

    elapsed: float

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def seconds(self) -> float:
        return self.elapsed


@dataclass(frozen=True, slots=True)
class _Events:
    """A copy enqueued on a CUDA stream between two timing events."""

    start: torch.cuda.Event
    end: torch.cuda.Event

    def done(self) -> bool:
        return self.end.query()

    def wait(self) -> None:
        self.end.synchronize()

    def seconds(self) -> float:
        return self.start.elapsed_time(self.end) / 1e3


@dataclass(slots=True)
class _Job:
    job_id: int
    lane: TransferLane
    size: int
    success: bool
    completion: _Completion
    # Host-side staging buffers the device may still read: dropped once the job is reported.
    keepalive: list[torch.Tensor] = field(default_factory=lambda: [])


class TransferEngine:
    """Runs store and load jobs between ``kv``'s GPU pages and ``slab``'s rows.

    ``backend`` is ``"auto"``, ``"triton"``, ``"dma"`` or ``"torch"`` (see
    :mod:`kvtriton.worker.backends`); ``num_programs`` caps the Triton grid. The
    slab's ``block_size_factor`` is the engine's: one slot holds that many GPU
    blocks. The engine holds the slab and registers itself as its user, so
    closing the slab first drains this engine's streams; :meth:`close` (or
    :meth:`shutdown`) drains them too, and so does garbage collection.
    """

    def __init__(
        self,
        kv: PagedKV,
        slab: HostSlab,
        backend: str | TransferBackend = "auto",
        *,
        num_programs: int = DEFAULT_NUM_PROGRAMS,
    ) -> None:
        if not isinstance(kv, PagedKV):  # pyright: ignore[reportUnnecessaryIsInstance] -- catch raw tensors passed by mistake
            raise TypeError(f"kv must be a PagedKV (see PagedKV.from_tensors), got {type(kv).__name__}")
        if not isinstance(slab, HostSlab):  # pyright: ignore[reportUnnecessaryIsInstance] -- same
            raise TypeError(f"slab must be a HostSlab, got {type(slab).__name__}")
        parsed = TransferBackend.parse(backend)
        if isinstance(num_programs, bool) or not isinstance(num_programs, int) or num_programs < 1:  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers
            raise ValueError(f"num_programs must be an int >= 1, got {num_programs!r}")
        if kv.device.type not in ("cpu", "cuda"):
            raise ValueError(f"kv must live on a CUDA device or the CPU, got {kv.device}")
        if slab.closed:
            raise ValueError("slab is closed")
        if slab.row_bytes < kv.row_bytes:
            raise ValueError(
                f"slab rows hold {slab.row_bytes} bytes but one block of kv needs {kv.row_bytes} "
                f"(page bytes {kv.page_bytes}); build the slab with row_bytes=kv.row_bytes"
            )
        self.kv = kv
        self.slab = slab
        self.block_size_factor = slab.block_size_factor
        self._backend: CopyBackend = make_backend(
            parsed, kv, slab.rows, slab_pinned=slab.pinned, num_programs=num_programs
        )
        self._cuda = kv.device.type == "cuda"
        self._streams: dict[TransferLane, torch.cuda.Stream] = {}
        if self._cuda:
            # Lower numbers are higher priorities: expedited loads overtake the other lanes' kernels.
            self._streams = {
                lane: torch.cuda.Stream(kv.device, priority=-1 if lane is TransferLane.EXPEDITED_LOAD else 0)
                for lane in TransferLane
            }
        self._queues: dict[TransferLane, deque[_Job]] = {lane: deque() for lane in TransferLane}
        self._unreported: set[int] = set()
        self._closed = False
        slab.add_user(self)
        logger.info(
            "transfer engine: %d page tensors, %d-byte rows, %d slots x %d rows, backend %s on %s",
            len(kv.pages), kv.row_bytes, slab.num_slots, slab.block_size_factor, self.backend.value, kv.device,
        )  # fmt: skip

    @property
    def backend(self) -> TransferBackend:
        """The concrete backend in use (``auto`` already resolved)."""
        return self._backend.kind

    def stream(self, lane: TransferLane) -> torch.cuda.Stream:
        """The CUDA stream ``lane``'s jobs run on (``ValueError`` on a CPU engine, which has none)."""
        if not self._cuda:
            raise ValueError(f"a CPU engine runs jobs inside submit_*; it has no {lane.value} stream")
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
                results.append(
                    TransferResult(
                        job_id=job.job_id,
                        success=job.success,
                        transfer_size=job.size if job.success else 0,
                        transfer_time=job.completion.seconds(),
                        transfer_type=lane.direction.transfer_type,
                    )
                )
        return results

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
        self._closed = True

    def close(self) -> None:
        """Same as :meth:`shutdown` (the slab is closed by its owner, after this)."""
        self.shutdown()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # A forgotten engine must not let the slab's memory go (unpinned or
        # unmapped) under copies still queued on its streams.
        try:
            self.drain()
        except Exception:  # noqa: BLE001 -- interpreter shutdown may have torn down CUDA already
            pass

    def _submit(self, job_id: int, lane: TransferLane, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec) -> bool:
        name = lane.value
        if self._closed:
            logger.warning("%s job %r refused: the engine is shut down", name, job_id)
            return False
        if isinstance(job_id, bool) or not isinstance(job_id, int):  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers
            logger.warning("%s job %r refused: job_id must be an int", name, job_id)
            return False
        if job_id in self._unreported:
            logger.warning("%s job %d refused: job id %d is still in flight or unreported", name, job_id, job_id)
            return False
        if not isinstance(cpu, CPULoadStoreSpec):
            logger.warning("%s job %d refused: the slot spec is a %s, not a CPULoadStoreSpec", name, job_id, type(cpu).__name__)
            return False
        try:
            plan = plan_transfer(
                lane.direction, gpu, cpu, self.block_size_factor,
                num_gpu_blocks=self.kv.num_blocks, num_slots=self.slab.num_slots,
            )  # fmt: skip
        except (TypeError, ValueError) as error:
            logger.warning("%s job %d refused: %s", name, job_id, error)
            return False
        if plan.num_rows == 0:
            # Nothing to move: done at once, on every backend and device, without touching a kernel or a stream.
            job = _Job(job_id, lane, 0, True, _Finished(0.0))
        elif self._cuda:
            job = self._launch_cuda(job_id, lane, plan)
        else:
            job = self._run_now(job_id, lane, plan)
        self._queues[lane].append(job)
        self._unreported.add(job_id)
        return True

    def _copy(self, job_id: int, lane: TransferLane, host: TransferPlan, device: TransferPlan) -> bool:
        """Run the backend; a raising copy fails only this job."""
        try:
            self._backend.copy(host, device)
        except Exception:
            logger.exception("%s job %d failed in the %s backend", lane.value, job_id, self.backend.value)
            return False
        return True

    def _run_now(self, job_id: int, lane: TransferLane, plan: TransferPlan) -> _Job:
        started = time.perf_counter()
        success = self._copy(job_id, lane, plan, plan)
        return _Job(job_id, lane, plan.num_rows * self.kv.row_bytes, success, _Finished(time.perf_counter() - started))

    def _launch_cuda(self, job_id: int, lane: TransferLane, plan: TransferPlan) -> _Job:
        stream = self._streams[lane]
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        # Every lane starts after the work already queued on the compute
        # stream: a store reads pages the model just wrote; a load overwrites
        # blocks that earlier steps may still read or zero (with async
        # scheduling nothing else orders them; vLLM's handler waits likewise).
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        keepalive: list[torch.Tensor] = []
        with torch.cuda.stream(stream):
            start.record(stream)
            device = plan
            if self._backend.wants_device_indices:
                staged = torch.empty((2, plan.num_rows), dtype=torch.int64, pin_memory=True)
                staged[0].copy_(plan.gpu_blocks)
                staged[1].copy_(plan.slab_rows)
                on_device = staged.to(self.kv.device, non_blocking=True)
                keepalive.append(staged)
                device = TransferPlan(plan.direction, on_device[0], on_device[1])
            success = self._copy(job_id, lane, plan, device)
            end.record(stream)
        return _Job(job_id, lane, plan.num_rows * self.kv.row_bytes, success, _Events(start, end), keepalive)
