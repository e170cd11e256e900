"""The three ways a transfer job's rows can be copied, and the one place that picks among them.

* ``triton``: one Triton gather/scatter launch per job (per page size or
  kind) through a :class:`~kvtriton.kernels._launch.CopyLauncher` prepared
  once per engine;
  compiled on CUDA, run by Triton's interpreter on CPU (where the
  interpreter cannot run, asking for ``triton`` is an error, never a silent
  torch copy).
* ``dma``: the copy engines. A job's pairs are split into runs that are
  consecutive in both GPU blocks and slab rows and lie in one CUDA
  registration of the slab (a copy spanning two registrations is rejected or
  staged as pageable by CUDA), and each run moves with one
  ``cudaMemcpy2DAsync`` per page tensor (a strided copy: block stride on one
  side, slab row stride on the other). Where the runtime has
  ``cudaMemcpyBatchAsync`` (CUDA 12.8 and later) and the slab is pinned, the
  whole job is instead one call: one copy per (row, page tensor), all queued
  at once (thousands of ctypes calls per shuffled job cost milliseconds of
  host time; one costs microseconds). :attr:`DmaCopy.submission` says which
  path a job takes. On CPU the runs move with one strided ``copy_`` each.
* ``torch``: the torch reference (``kvtriton.kernels._reference``), the oracle
  of the tests; on CUDA it gathers into a device staging buffer, then moves
  runs of slab rows with the DMA backend's strided copy.

:func:`choose_backend` makes the decision, once per engine and direction,
from :data:`AUTO_TABLE` when the caller asked for ``auto``:

==========  ============  =========  =================  ========
device      slab          direction  smallest page (B)  backend
==========  ============  =========  =================  ========
cuda        pinned        store      0 and up           triton
cuda        pinned        load       0 and up           triton
cuda        pageable      both       any                dma
cpu         any           both       any                torch
==========  ============  =========  =================  ========

(The kernel cannot reach pageable host memory, hence ``dma`` there; nor a
pinned slab whose registrations the device reaches at other addresses than
the host's, see ``HostSlab.device_aliased``: ``auto`` then takes ``dma`` and
asking for ``triton`` is an error.) The CUDA rows are where
``bench/crossover.py`` (run by ``bench/gpu_check.sh``) puts the crossover: it
prints, per direction, the page size from which ``dma`` wins, and the
``AutoRule`` line to add for it (docs/worker.md, "Setting AUTO_TABLE").

With fp8 compression (``PagedKV.compression``) ``triton`` runs the fused
quantizing kernels (the same launcher, given the row layout) and ``torch`` the
compressed reference; ``dma`` cannot compress (a copy engine only moves
bytes), so where ``auto`` would take ``dma`` it takes ``triton`` for a pinned
slab the kernel reaches and ``torch`` otherwise (a pageable slab, or a pinned
one reached at other addresses), and asking for ``dma`` is an error. The
compressed torch reference reads the device back twice per job (deduplication
and the NaN flag): on a pageable slab's worker thread that costs nothing the
blocking copy did not already cost, on vLLM's scheduler thread it would.

A backend only copies: the engine plans, stages indices, orders and times jobs.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from numpy.typing import NDArray

from kvtriton._choices import parse_choice
from kvtriton.kernels import (
    DEFAULT_BYTES_PER_ITER,
    DEFAULT_NUM_PROGRAMS,
    CopyLauncher,
    PageGeometry,
    gather_unchecked,
    interpreter_problem,
    scatter_unchecked,
)
from kvtriton.worker._cudart import MemcpyBatch, loaded_cudart, memcpy_2d_async, memcpy_batch
from kvtriton.worker._layout import PagedKV
from kvtriton.worker._plan import TransferDirection, TransferPlan, host_tensor


class TransferBackend(enum.Enum):
    """Which implementation copies a job's rows (see the module docstring)."""

    AUTO = "auto"
    TRITON = "triton"
    DMA = "dma"
    TORCH = "torch"

    @classmethod
    def parse(cls, value: str | TransferBackend, argument: str = "backend") -> TransferBackend:
        """The member called ``value``; anything else raises ``ValueError`` naming ``argument`` and the valid values."""
        return parse_choice(cls, value, argument)


@dataclass(frozen=True, slots=True)
class AutoRule:
    """One row of :data:`AUTO_TABLE`: ``None`` matches anything."""

    device_type: str
    slab_pinned: bool | None
    direction: TransferDirection | None
    min_page_bytes: int
    backend: TransferBackend


AUTO_TABLE: tuple[AutoRule, ...] = (
    AutoRule("cuda", True, TransferDirection.STORE, 0, TransferBackend.TRITON),
    AutoRule("cuda", True, TransferDirection.LOAD, 0, TransferBackend.TRITON),
    AutoRule("cuda", False, None, 0, TransferBackend.DMA),
    AutoRule("cpu", None, None, 0, TransferBackend.TORCH),
)
"""What ``auto`` means: the last matching row wins (rows are ordered by ``min_page_bytes``)."""


def choose_backend(
    requested: TransferBackend,
    direction: TransferDirection,
    *,
    device: torch.device,
    slab_pinned: bool,
    page_bytes: int,
    slab_device_aliased: bool = True,
    compressed: bool = False,
) -> TransferBackend:
    """The backend that will really copy ``direction`` jobs; raises ``ValueError`` when ``requested`` cannot run.

    ``page_bytes`` is the engine's smallest page (the case where per-copy
    overheads weigh most). ``slab_device_aliased`` is False when a pinned
    slab's registrations are reached on the device at other addresses than
    the host's: the kernel cannot address such a slab, ``dma`` can.
    ``compressed``: the rows are fp8-compressed, which ``dma`` cannot do
    (``auto`` then takes ``triton`` instead of ``dma`` where the kernel can
    reach the slab, ``torch`` where it cannot).
    """
    if compressed and requested is TransferBackend.DMA:
        raise ValueError(
            "backend='dma' cannot compress (the copy engines only move bytes); with kv_compression='fp8-e4m3' "
            "use backend='triton', 'torch' or 'auto'"
        )
    if requested is TransferBackend.AUTO and device.type == "cuda" and slab_pinned and not slab_device_aliased:
        requested = TransferBackend.TORCH if compressed else TransferBackend.DMA
    if requested is TransferBackend.AUTO:
        chosen: TransferBackend | None = None
        for rule in AUTO_TABLE:
            if (
                rule.device_type == device.type
                and rule.slab_pinned in (None, slab_pinned)
                and rule.direction in (None, direction)
                and page_bytes >= rule.min_page_bytes
            ):
                chosen = rule.backend
        if chosen is None:
            raise ValueError(f"no backend for {direction.name.lower()} jobs on {device} in AUTO_TABLE")
        if compressed and chosen is TransferBackend.DMA:
            # The copy engines cannot quantize: a pinned slab the kernel reaches takes the fused kernels (no sync,
            # no staging); a pageable one the torch reference, whose syncs its worker thread absorbs.
            chosen = TransferBackend.TRITON if slab_pinned and slab_device_aliased else TransferBackend.TORCH
        requested = chosen
    if requested is TransferBackend.TRITON:
        if device.type == "cuda" and not slab_pinned:
            raise ValueError(
                "backend='triton' needs a pinned slab on CUDA (the kernel cannot reach pageable host memory); "
                "pin the slab or use backend='dma'"
            )
        if device.type == "cuda" and not slab_device_aliased:
            raise ValueError(
                "backend='triton' needs every registration of the pinned slab to be reached on the device at its host "
                "address (cudaHostGetDevicePointer differs here: cudaDevAttrCanUseHostPointerForRegisteredMem is 0); "
                "use backend='dma'"
            )
        if device.type == "cpu":
            problem = interpreter_problem()  # imports triton
            if problem is not None:
                raise ValueError(
                    f"backend='triton' on CPU runs Triton's interpreter, but {problem}; use backend='torch'"
                )
    return requested


@dataclass(frozen=True, slots=True)
class DeviceIndices:
    """A job's indices on the pages' device, each starting on a 16-byte boundary (the staging guarantees it).

    ``status``: one int32 (pinned host memory on CUDA) that a compressed
    store sets to 1 when the pages hold NaN or infinity (the rows then hold
    NaN codes there); the engine reads it once the job has finished and
    counts the event (the job still succeeds: see ``TransferEngine.stats``).
    """

    gpu_blocks: torch.Tensor
    slab_rows: torch.Tensor
    status: torch.Tensor | None = None


class CopyBackend(Protocol):
    """Copies the rows of one planned job; raises on failure, before or while copying."""

    @property
    def kind(self) -> TransferBackend: ...

    @property
    def wants_device_indices(self) -> bool:
        """True when :meth:`copy` reads ``device`` (index tensors on the pages' device)."""
        ...

    @property
    def submission(self) -> str:
        """How a job's copies reach CUDA, for people (``""`` where nothing is submitted to the copy engines)."""
        ...

    def warm_up(self) -> None:
        """Compile whatever a job can need (nothing, for backends that do not compile)."""
        ...

    def copy(self, plan: TransferPlan, device: DeviceIndices | None) -> None:
        """Run ``plan.direction`` for the pairs of the plan on the current stream.

        ``plan`` holds the host indices; ``device`` the same indices on the
        pages' device when :attr:`wants_device_indices`, else None.
        """
        ...


class TritonCopy:
    """One gather or scatter launch per job (per page kind when the rows are compressed)."""

    kind = TransferBackend.TRITON
    wants_device_indices = True
    submission = ""

    def __init__(self, kv: PagedKV, slab: torch.Tensor, num_programs: int) -> None:
        self.launcher = CopyLauncher(
            kv.pages,
            slab,
            kv.geometry,
            compression=kv.compression_layout,
            interpret=kv.device.type == "cpu",
            num_programs=num_programs,
            bytes_per_iter=DEFAULT_BYTES_PER_ITER,
        )

    def warm_up(self) -> None:
        self.launcher.warm_up(torch.int64)

    def copy(self, plan: TransferPlan, device: DeviceIndices | None) -> None:
        assert device is not None
        # The planner checked ranges and uniqueness on the host: the launch reads nothing back.
        self.launcher.launch(
            plan.direction is TransferDirection.STORE, device.gpu_blocks, device.slab_rows, device.status
        )


@dataclass(frozen=True, slots=True)
class _PitchedPages:
    """Addresses and pitches of every page tensor and of the slab, computed once per engine."""

    page_bases: NDArray[np.int64]
    block_strides: NDArray[np.int64]
    page_bytes: NDArray[np.int64]
    row_offsets: NDArray[np.int64]
    slab_base: int
    slab_stride: int

    @classmethod
    def of(cls, kv: PagedKV, slab: torch.Tensor) -> _PitchedPages:
        geometry: PageGeometry = kv.geometry
        return cls(
            page_bases=np.array([page.data_ptr() for page in kv.pages], dtype=np.int64),
            block_strides=np.array(geometry.block_strides, dtype=np.int64),
            page_bytes=np.array(geometry.page_bytes, dtype=np.int64),
            row_offsets=np.array(geometry.row_offsets, dtype=np.int64),
            slab_base=slab.data_ptr(),
            slab_stride=slab.stride(0) if slab.shape[0] > 1 else slab.shape[1],
        )

    def pair_copies(
        self, blocks: NDArray[np.int64], rows: NDArray[np.int64], store: bool
    ) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        """Destination, source and size of one copy per (page tensor, pair), for :class:`MemcpyBatch`."""
        pages = (self.page_bases[:, None] + blocks[None, :] * self.block_strides[:, None]).ravel()
        slab = (self.slab_base + rows[None, :] * self.slab_stride + self.row_offsets[:, None]).ravel()
        sizes = np.repeat(self.page_bytes, blocks.shape[0])
        return (slab, pages, sizes) if store else (pages, slab, sizes)


def _batch_for(slab: torch.Tensor, slab_pinned: bool | None) -> MemcpyBatch | None:
    """The runtime's batch call for copies to and from a pinned slab; None for a pageable one or an old runtime.

    A pageable slab's copies are staged by the driver on the lane's worker
    thread whatever the call; they keep the per-run path, the one measured.
    """
    pinned = slab.is_pinned() if slab_pinned is None else slab_pinned
    return memcpy_batch() if pinned else None


def _submission(batch: MemcpyBatch | None) -> str:
    return "cudaMemcpyBatchAsync per job" if batch is not None else "cudaMemcpy2DAsync per run"


def _require_cudart(backend: str) -> None:
    """Refuse at engine build, not at the first job, when the strided copy cannot be issued."""
    if loaded_cudart() is None:
        raise ValueError(
            f"backend={backend!r} on CUDA issues cudaMemcpy2DAsync from the libcudart torch loaded, "
            "but no libcudart is mapped into this process; use backend='triton' with a pinned slab"
        )


def _runs(breaks: NDArray[np.bool_]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Start and length of each run, given where a new run begins (``breaks[0]`` is True)."""
    starts = np.flatnonzero(breaks).astype(np.int64)
    return starts, np.diff(np.append(starts, np.int64(breaks.shape[0])))


def _registration_breaks(rows: NDArray[np.int64], registration_rows: int | None) -> NDArray[np.bool_]:
    """True where ``rows[i]`` starts a slab registration (a run must not continue into it)."""
    if registration_rows is None:
        return np.zeros(len(rows) - 1, dtype=np.bool_)
    return np.equal(rows[1:] % registration_rows, 0)


def dma_runs(
    plan: TransferPlan, registration_rows: int | None = None
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """First block, first row and length of each run consecutive on both sides and inside one registration.

    ``registration_rows`` is the slab's rows per CUDA registration
    (``HostSlab.registration_rows``): runs are cut where a registration starts.
    """
    blocks, rows = plan.gpu_blocks, plan.slab_rows
    if rows.shape[0] == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.ones(rows.shape[0], dtype=np.bool_)
    breaks[1:] = (
        (blocks[1:] != blocks[:-1] + 1) | (rows[1:] != rows[:-1] + 1) | _registration_breaks(rows, registration_rows)
    )
    starts, lengths = _runs(breaks)
    return blocks[starts], rows[starts], lengths


def slab_row_runs(
    rows: NDArray[np.int64], registration_rows: int | None = None
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Start (position in ``rows``) and length of each run of consecutive slab rows inside one registration."""
    if rows.shape[0] == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    breaks = np.ones(rows.shape[0], dtype=np.bool_)
    breaks[1:] = (rows[1:] != rows[:-1] + 1) | _registration_breaks(rows, registration_rows)
    return _runs(breaks)


class _CopyEngineCopy:
    """What the ``dma`` and ``torch`` backends share: on CUDA, the copy engines move slab rows.

    ``slab_pinned`` (None: ``slab.is_pinned()``, which asks about the first
    byte of the slab's storage) picks the batch call for a pinned slab;
    ``batched=False`` keeps the per-run path even then (bench/kernels.py
    times both, as ``dma`` and ``dma-2d``).
    """

    kind: TransferBackend
    compresses = True
    """Whether it can store rows compressed (``kv_compression``); the dma backend moves the pages' bytes as they are."""

    def __init__(
        self,
        kv: PagedKV,
        slab: torch.Tensor,
        registration_rows: int | None = None,
        *,
        slab_pinned: bool | None = None,
        batched: bool = True,
    ) -> None:
        if kv.compression_layout is not None and not self.compresses:
            raise ValueError(
                f"the {self.kind.value} backend cannot compress rows; kv_compression='fp8-e4m3' needs 'triton' or"
                " 'torch'"
            )
        self.kv = kv
        self.slab = slab
        self.registration_rows = registration_rows
        self._cuda = kv.device.type == "cuda"
        self._batch: MemcpyBatch | None = None
        if self._cuda:
            _require_cudart(self.kind.value)
            self._batch = _batch_for(slab, slab_pinned) if batched else None
        self._pitched = _PitchedPages.of(kv, slab)

    @property
    def submission(self) -> str:
        return _submission(self._batch) if self._cuda else ""

    def warm_up(self) -> None:
        return None


class DmaCopy(_CopyEngineCopy):
    """One batched call per job, or one strided copy per (run of consecutive blocks and rows, page tensor)."""

    kind = TransferBackend.DMA
    wants_device_indices = False
    compresses = False

    @functools.cached_property
    def _byte_pages(self) -> list[torch.Tensor]:
        """The page tensors as bytes, for the copies on the host (made at the first)."""
        return self.kv.byte_pages()

    def batch_arrays(self, plan: TransferPlan) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        """Destination, source and size of every copy the batch call queues for ``plan``: one per (page tensor, pair).

        Host work per job on the batch path (bench/host_cost.py times it at 64 and 160 page tensors).
        """
        return self._pitched.pair_copies(plan.gpu_blocks, plan.slab_rows, plan.direction is TransferDirection.STORE)

    def copy(self, plan: TransferPlan, device: DeviceIndices | None) -> None:
        del device
        store = plan.direction is TransferDirection.STORE
        if self._batch is not None:
            # Each copy is one page of one row: none spans two registrations, no runs needed.
            stream = torch.cuda.current_stream(self.kv.device).cuda_stream
            self._batch(*self.batch_arrays(plan), stream)
            return
        blocks, rows, lengths = dma_runs(plan, self.registration_rows)
        if not self._cuda:
            self._copy_on_host(store, blocks, rows, lengths)
            return
        p = self._pitched
        # (page tensor, run) addresses, vectorised; the loop below only issues the calls.
        page_addresses = p.page_bases[:, None] + blocks[None, :] * p.block_strides[:, None]
        slab_addresses = p.slab_base + rows[None, :] * p.slab_stride + p.row_offsets[:, None]
        stream = torch.cuda.current_stream(self.kv.device).cuda_stream
        for t in range(len(p.page_bases)):
            width, page_pitch = int(p.page_bytes[t]), int(p.block_strides[t])
            for page_address, slab_address, height in zip(
                page_addresses[t].tolist(), slab_addresses[t].tolist(), lengths.tolist()
            ):
                if store:
                    memcpy_2d_async(slab_address, p.slab_stride, page_address, page_pitch, width, height, stream)
                else:
                    memcpy_2d_async(page_address, page_pitch, slab_address, p.slab_stride, width, height, stream)

    def _copy_on_host(
        self, store: bool, blocks: NDArray[np.int64], rows: NDArray[np.int64], lengths: NDArray[np.int64]
    ) -> None:
        for page, offset, size in zip(self._byte_pages, self.kv.page_offsets, self.kv.page_bytes):
            columns = self.slab[:, offset : offset + size]
            for block, row, length in zip(blocks.tolist(), rows.tolist(), lengths.tolist()):
                slab_part, page_part = columns[row : row + length], page[block : block + length]
                if store:
                    slab_part.copy_(page_part)
                else:
                    page_part.copy_(slab_part)


class TorchCopy(_CopyEngineCopy):
    """The torch reference; on CUDA it stages rows in a device buffer, then moves runs of slab rows."""

    kind = TransferBackend.TORCH

    @property
    def wants_device_indices(self) -> bool:
        # A compressed store reports NaN through the status word staged with the indices, on CPU too.
        return self._cuda or self.kv.compression_layout is not None

    def _gather(
        self, slab: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor, status: torch.Tensor | None
    ) -> None:
        layout = self.kv.compression_layout
        if layout is not None and status is None:
            raise ValueError("a compressed store needs the job's status word to report NaN or infinity")
        if not gather_unchecked(self.kv.pages, slab, blocks, rows, self.kv.geometry, layout) and status is not None:
            status[0] = 1  # the kernel's contract: the NaN codes are written, the flag says so

    def _scatter(self, slab: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor) -> None:
        scatter_unchecked(slab, self.kv.pages, rows, blocks, self.kv.geometry, self.kv.compression_layout)

    def copy(self, plan: TransferPlan, device: DeviceIndices | None) -> None:
        store = plan.direction is TransferDirection.STORE
        status = None if device is None else device.status
        if not self._cuda:
            blocks, rows = host_tensor(plan.gpu_blocks), host_tensor(plan.slab_rows)
            if store:
                self._gather(self.slab, blocks, rows, status)
            else:
                self._scatter(self.slab, rows, blocks)
            return
        assert device is not None
        count, width = plan.num_rows, self.kv.row_bytes
        staging = torch.empty((count, width), dtype=torch.uint8, device=self.kv.device)
        local = torch.arange(count, dtype=torch.int64, device=self.kv.device)
        if store:
            self._gather(staging, device.gpu_blocks, local, status)
        stream = torch.cuda.current_stream(self.kv.device).cuda_stream
        slab_stride = self._pitched.slab_stride
        if self._batch is not None:
            staged = staging.data_ptr() + np.arange(count, dtype=np.int64) * width
            slab_rows = self._pitched.slab_base + plan.slab_rows * slab_stride
            sizes = np.full(count, width, dtype=np.int64)
            self._batch(*((slab_rows, staged) if store else (staged, slab_rows)), sizes, stream)
            if not store:
                self._scatter(staging, local, device.gpu_blocks)
            return
        starts, lengths = slab_row_runs(plan.slab_rows, self.registration_rows)
        for start, length in zip(starts.tolist(), lengths.tolist()):
            slab_address = self._pitched.slab_base + int(plan.slab_rows[start]) * slab_stride
            staged_address = staging.data_ptr() + start * width
            if store:
                memcpy_2d_async(slab_address, slab_stride, staged_address, width, width, length, stream)
            else:
                memcpy_2d_async(staged_address, width, slab_address, slab_stride, width, length, stream)
        if not store:
            self._scatter(staging, local, device.gpu_blocks)


def make_backend(
    backend: TransferBackend,
    kv: PagedKV,
    slab: torch.Tensor,
    *,
    num_programs: int = DEFAULT_NUM_PROGRAMS,
    registration_rows: int | None = None,
    slab_pinned: bool | None = None,
) -> CopyBackend:
    """Build a concrete (already chosen) backend for ``kv`` and ``slab``.

    ``registration_rows``: the slab's rows per CUDA registration, where the
    ``dma`` and ``torch`` backends cut their runs (None: one registration or
    a pageable slab). ``slab_pinned``: whether the slab is registered
    (``HostSlab.pinned``; None: ask ``slab.is_pinned()``), which lets those
    two backends batch a job's copies into one call.
    """
    if backend is TransferBackend.TRITON:
        return TritonCopy(kv, slab, num_programs)
    if backend is TransferBackend.DMA:
        return DmaCopy(kv, slab, registration_rows, slab_pinned=slab_pinned)
    if backend is TransferBackend.TORCH:
        return TorchCopy(kv, slab, registration_rows, slab_pinned=slab_pinned)
    raise ValueError(f"make_backend needs a concrete backend, got {backend.value!r}; resolve it with choose_backend")
