"""SharedRegion: one host region in /dev/shm that the scheduler and every worker rank map.

vLLM's tiered offloading runs its secondary tiers (``fs``, ``obj``, ``p2p``) in
the scheduler process, and they copy whole chunks of the primary tier's host
memory. The slab the workers fill therefore has to be one shared mapping: the
scheduler maps all of it, and every worker rank writes its own bytes at its
offset inside every row (a strided view, which the kernels take as they take
any slab).

Layout (:class:`RegionLayout`). A *chunk* is what a secondary tier stores as
one object: ``block_size_factor`` GPU blocks of every rank (vLLM's ``blocks_per_chunk``). A *block row* is
one GPU block of every rank, rank after rank, ``rank_row_bytes`` each::

    chunk c:  [ block row c*f   : rank0 | rank1 | ... | pad ]
              [ block row c*f+1 : rank0 | rank1 | ... | pad ]   (f = block_size_factor)

Block rows are padded so that every chunk is a multiple of
:data:`ROW_ALIGNMENT` (4096 bytes, or the host page if larger) and starts on
that boundary: vLLM's ``fs`` tier reads and writes chunks with ``O_DIRECT``.
Each block row keeps at least :data:`~kvtriton._integrity.SEAL_BYTES` of
padding, so the last :data:`~kvtriton._integrity.SEAL_BYTES` of every chunk
(inside its last row's padding) hold the chunk's seal: the secondary tiers
store and return it with the chunk's bytes, and the workers' copies, which
write each rank's bytes only, never touch it. The bytes of a chunk therefore
differ from vLLM's own CPU primary tier's (``SharedOffloadRegion``), and the
integration files them under a namespace of their own (see
:mod:`kvtriton.integrations.vllm._tiered_spec`).

Lifetime (:class:`SharedRegion`). The first process to arrive creates the file
(after checking /dev/shm has room) and publishes its header at once, the
others open it and wait only for that header (a page: milliseconds, whatever
the region's size). Nobody pre-faults the whole region before others may
join: at ~10 GiB/s a region of hundreds of GB would take longer than any
join timeout. Instead each worker rank populates its own bytes of every row
when it takes its slab (:meth:`SharedRegion.rank_slab`), on the CPUs of its
GPU's NUMA node, so that each rank's bytes sit next to the GPU that copies
them, then counts itself in the header (``populated_count``). A rank pins
only once every rank has populated (it waits for the count to reach
``world_size``, at most ``populate_timeout_s``): pinning earlier would fault
the pages it shares with a rank still populating onto its own node. Each
rank registers every whole block row, the other ranks' bytes included, in
pieces of about a GiB (:data:`~kvtriton.worker._slab.PIN_CHUNK_BYTES`): its
own bytes sit a block row apart, so registering them alone would take one
``cudaHostRegister`` per block row (tens of thousands for a 100 GB region,
whatever the tensor parallelism; with one rank, every row whenever the
seal's padding fills a page). The cost is pinning time: each rank pins the
whole region, ``world_size`` times its own bytes (the pages are shared, so
no more RAM is locked).

Pinning refused (:class:`~kvtriton.worker._slab.HostMemoryPath`). A rank
whose registration CUDA refuses (a GPU in confidential-computing mode
refuses every size; a driver's size cap; a container's limits) cannot take
other memory: the region is the memory every process shares. Every rank
counts its outcome in the header (``PIN_REPORTED``, ``PIN_REFUSED``), waits
until all have (at most ``populate_timeout_s``), and if any was refused all
of them unpin and copy through pageable memory (the ``dma`` backend on the
engine's copy threads): one path for the whole engine, decided from the same
counts by every rank, with one WARNING, logged by the first refused rank.
The path taken is kept in the header too (the slowest rank's), where the
scheduler reads it (:attr:`SharedRegion.memory_path`) for the gauge. Pages no rank populated (padding) are faulted in
by the first process that touches them. The file itself (its name, header,
locks, and when a stale one is removed) is :mod:`kvtriton.worker._region_file`'s:
it appears under its name complete, every process that maps it holds a shared
lock on it, and the process that brings the header's mapper count to
``expected_mappers`` unlinks it; from then on the memory lives exactly as long
as some process maps it. A crash before the count completes (during start-up)
leaves the file, unheld: the next process to open any region on the host
removes it, whatever its engine id, and a file under this engine's name that
is empty, torn, unheld or left by a dead creator is replaced, never waited on.
:meth:`SharedRegion.close` also unlinks it, for a process set that never
completed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from numpy.typing import NDArray

from kvtriton._int_argument import check_int
from kvtriton._integrity import SEAL_BYTES
from kvtriton._region_rows import ROW_ALIGNMENT, block_row_stride
from kvtriton.worker._closing import ClosesOnExit
from kvtriton.worker._cudart import error_name
from kvtriton.worker._numa import on_gpu_node, placement_gpu
from kvtriton.worker._region_file import (
    CREATOR,
    FIRST_REFUSAL,
    HEADER_BYTES,
    LAYOUT_AT,
    LAYOUT_LENGTH,
    MAGIC,
    MAPPED,
    MEMORY_PATH,
    PIN_REFUSED,
    PIN_REPORTED,
    POPULATED,
    REGION_DIRECTORY,
    REGION_MODE,
    HeaderField,
    close_region_fd,
    header_locked,
    hold_shared,
    is_same_file,
    nobody_holds,
    process_alive,
    refuse_unless_private,
    region_path,
    remove_stale_regions,
    staging_path,
)
from kvtriton.worker._slab import HostMemoryPath, HostSlab, PinRefusal

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0
"""How long a joining process waits for its shared lock while another process judges whether the file is stale
(the time of a ``stat`` and an ``unlink``: only a stopped process holds it longer)."""
_OPEN_ATTEMPTS = 4
"""Tries at creating or joining the region before giving up: each failed one replaced a stale file or lost a race."""
POPULATE_TIMEOUT_S = 600.0
"""How long a rank about to pin waits for every rank to populate its bytes (ranks load their model first, unevenly)."""
_POLL_S = 0.005


@dataclass(frozen=True, slots=True)
class RegionLayout:
    """Where every rank's bytes of every GPU block sit in a shared region (see the module docstring)."""

    num_chunks: int
    """Chunks (slots) in the region: the primary tier's capacity."""
    block_size_factor: int
    """GPU blocks per chunk (the slab's ``block_size_factor``)."""
    world_size: int
    """Worker ranks writing the region."""
    rank_row_bytes: int
    """One rank's KV bytes of one GPU block (every rank holds the same amount)."""

    def __post_init__(self) -> None:
        check_int("num_chunks", self.num_chunks, minimum=1)
        check_int("block_size_factor", self.block_size_factor, minimum=1)
        check_int("world_size", self.world_size, minimum=1)
        check_int("rank_row_bytes", self.rank_row_bytes, minimum=1)

    @staticmethod
    def block_row_stride_for(block_size_factor: int, world_size: int, rank_row_bytes: int) -> int:
        """Bytes from one block row to the next (:func:`kvtriton._region_rows.block_row_stride`)."""
        return block_row_stride(block_size_factor, world_size, rank_row_bytes)

    @classmethod
    def for_budget(
        cls, cpu_bytes_to_use: int, block_size_factor: int, world_size: int, rank_row_bytes: int
    ) -> RegionLayout:
        """As many chunks as ``cpu_bytes_to_use`` (all ranks together, as vLLM counts it) holds.

        Raises ``ValueError`` naming both sizes when not even one chunk fits.
        """
        check_int("cpu_bytes_to_use", cpu_bytes_to_use, minimum=1)
        chunk = block_size_factor * cls.block_row_stride_for(block_size_factor, world_size, rank_row_bytes)
        if cpu_bytes_to_use < chunk:
            raise ValueError(
                f"cpu_bytes_to_use={cpu_bytes_to_use} holds no chunk: one chunk of {block_size_factor} GPU block(s) "
                f"x {world_size} rank(s) x {rank_row_bytes} bytes and its {SEAL_BYTES}-byte seal, padded to "
                f"{ROW_ALIGNMENT}, takes {chunk} bytes"
            )
        return cls(cpu_bytes_to_use // chunk, block_size_factor, world_size, rank_row_bytes)

    @property
    def block_row_stride(self) -> int:
        """Bytes from one block row to the next (all ranks' bytes of a block, plus padding)."""
        return self.block_row_stride_for(self.block_size_factor, self.world_size, self.rank_row_bytes)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk: what a secondary tier stores per key (a multiple of ROW_ALIGNMENT)."""
        return self.block_size_factor * self.block_row_stride

    @property
    def seal_offset(self) -> int:
        """Where a chunk's seal starts inside the chunk: its last ``SEAL_BYTES``; the bytes before are its payload."""
        return self.chunk_bytes - SEAL_BYTES

    @property
    def num_block_rows(self) -> int:
        return self.num_chunks * self.block_size_factor

    @property
    def region_bytes(self) -> int:
        """Bytes of all chunks (the header page not included)."""
        return self.num_chunks * self.chunk_bytes

    def rank_offset(self, rank: int) -> int:
        """Where ``rank``'s bytes start inside every block row."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank}")
        return rank * self.rank_row_bytes

    def describe(self) -> str:
        return (
            f"{self.num_chunks} chunks x {self.block_size_factor} block(s) x {self.world_size} rank(s) x "
            f"{self.rank_row_bytes} bytes (block rows every {self.block_row_stride} bytes, "
            f"{self.chunk_bytes}-byte chunks sealed in their last {SEAL_BYTES}, {self.region_bytes} bytes)"
        )


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+


def rank_row_starts(layout: RegionLayout, rank: int) -> NDArray[np.int64]:
    """File offset of ``rank``'s bytes in every block row (``rank_row_bytes`` each; the header included)."""
    rows = np.arange(layout.num_block_rows, dtype=np.int64)
    return HEADER_BYTES + rows * layout.block_row_stride + layout.rank_offset(rank)


def page_spans(starts: NDArray[np.int64], length: int, page: int = mmap.PAGESIZE) -> list[tuple[int, int]]:
    """The whole pages covering ``[start, start + length)`` for each (increasing) start, merged: ``(offset, length)``.

    Vectorised: a region has millions of rows, the spans are what the loop visits.
    """
    if starts.shape[0] == 0:
        return []
    firsts = starts - starts % page
    ends = -(-(starts + length) // page) * page
    breaks = np.flatnonzero(firsts[1:] > ends[:-1])
    span_firsts = np.concatenate([firsts[:1], firsts[breaks + 1]])
    span_ends = np.concatenate([ends[breaks], ends[-1:]])
    return [(int(first), int(end - first)) for first, end in zip(span_firsts.tolist(), span_ends.tolist())]


def _populate_rank(region: mmap.mmap, fd: int, layout: RegionLayout, rank: int) -> None:
    """Allocate the pages holding ``rank``'s bytes now, not on the first copy into them (a fault per page, mid-transfer).

    ``madvise(MADV_POPULATE_WRITE)`` per span of whole pages where the kernel
    has it (it never changes what the pages hold, so pages shared with another
    rank are safe); otherwise the spans are allocated (``posix_fallocate``) and
    then written one byte per page, a byte of this rank's own (rewritten with
    its value: other ranks' bytes are never written). When the tmpfs has no
    room left (it filled after the region was sized) this raises ``OSError``
    (``EFAULT``, ``ENOMEM`` or ``ENOSPC``) instead of the ``SIGBUS`` a write into
    an unallocatable page would kill the process with.
    """
    starts = rank_row_starts(layout, rank)
    spans = page_spans(starts, layout.rank_row_bytes)
    try:
        for offset, length in spans:
            region.madvise(_MADV_POPULATE_WRITE, offset, length)
        return
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise  # no room: a SIGBUS had the page been written
    # Linux before 5.14 (no such advice): allocate, then touch the pages one by one.
    for offset, length in spans:
        os.posix_fallocate(fd, offset, length)
    view = memoryview(region)
    try:
        for start in starts.tolist():
            touch = start
            while touch < start + layout.rank_row_bytes:
                view[touch] = view[touch]
                touch = touch - touch % mmap.PAGESIZE + mmap.PAGESIZE
    finally:
        view.release()


def shm_free_bytes(directory: str = REGION_DIRECTORY) -> int:
    """Bytes an unprivileged process may still allocate in ``directory`` (statvfs ``f_bavail``)."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


class SharedRegion(ClosesOnExit):
    """One region file, mapped by this process (see the module docstring).

    ``name`` identifies the engine (one region per engine and data-parallel
    replica); ``expected_mappers`` is how many processes will map it (the
    scheduler plus every worker rank); the one that completes the count
    unlinks the file. A process joining a region created with another layout
    raises ``ValueError`` naming both: its ranks disagree on the KV bytes per
    block (uneven pipeline stages) or on the budget.
    """

    def __init__(
        self,
        name: str,
        layout: RegionLayout,
        expected_mappers: int,
        *,
        directory: str = REGION_DIRECTORY,
        join_timeout_s: float = JOIN_TIMEOUT_S,
    ) -> None:
        if not isinstance(name, str) or not name or "/" in name:  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers
            raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
        check_int("expected_mappers", expected_mappers, minimum=1)
        if not os.path.isdir(directory):
            raise ValueError(
                f"directory {directory!r} does not exist; the shared host region needs a tmpfs such as /dev/shm"
            )
        self.layout = layout
        self.path = region_path(directory, name)
        self.file_bytes = HEADER_BYTES + layout.region_bytes
        self._expected = expected_mappers
        self._unlinked = False
        self._mmap: mmap.mmap | None = None
        self._tensors: list[torch.Tensor] = []
        self._views: list[memoryview] = []
        self._fd = -1
        self._file: os.stat_result | None = None  # the file this process mapped (its name may be another's later)
        self._populated_ranks: set[int] = set()
        self._reported_ranks: set[int] = set()
        self._refused_ranks: set[int] = set()
        remove_stale_regions(directory)
        for _ in range(_OPEN_ATTEMPTS):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
            except FileNotFoundError:
                if self._create(directory):
                    break
            else:
                if self._join(fd, join_timeout_s):
                    break
        else:
            raise RuntimeError(
                f"could neither create nor join {self.path} in {_OPEN_ATTEMPTS} tries: each time another process "
                "replaced or removed it first; see the other engines' logs"
            )
        self._register_mapping()

    # --- creation and joining -----------------------------------------

    def _create(self, directory: str) -> bool:
        """Make the region in a staging file and link it under :attr:`path`; False when another process was first.

        The staging file is locked from its first moment and carries the
        creator's pid in its name, so nobody removes it as stale; the header
        is complete before the region's name exists (no joiner ever waits
        for it).
        """
        staging = staging_path(self.path)
        fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, REGION_MODE)
        published = False
        try:
            hold_shared(fd, staging, JOIN_TIMEOUT_S)  # nobody else knows the file yet: at once
            os.fchmod(fd, REGION_MODE)  # exactly, whatever the umask
            self._fd = fd
            free = shm_free_bytes(directory)
            if self.file_bytes > free:
                raise ValueError(
                    f"{directory} has {free} bytes free but the shared host region needs {self.file_bytes} bytes "
                    f"({self.layout.describe()}); lower cpu_bytes_to_use or enlarge {directory} "
                    f"(docker: --shm-size; Kubernetes: an emptyDir with medium: Memory)"
                )
            os.ftruncate(fd, self.file_bytes)
            self._mmap = mmap.mmap(fd, self.file_bytes, flags=mmap.MAP_SHARED)
            # No pre-faulting here: joiners wait for nothing; ranks populate their own bytes (rank_slab).
            layout_json = json.dumps(asdict(self.layout), sort_keys=True).encode()
            if LAYOUT_AT + len(layout_json) > HEADER_BYTES:
                raise ValueError(
                    f"the region layout description ({len(layout_json)} bytes) does not fit the header page"
                )
            CREATOR.write(self._mmap, os.getpid())
            LAYOUT_LENGTH.write(self._mmap, len(layout_json))
            self._mmap[LAYOUT_AT : LAYOUT_AT + len(layout_json)] = layout_json
            self._mmap[: len(MAGIC)] = MAGIC
            try:
                os.link(staging, self.path)
                published = True
            except FileExistsError:
                pass  # another process of this engine was first: join its region
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
            if not published:
                self._close_mapping()
        if not published:
            return False
        self._file = os.fstat(fd)
        logger.info("created shared host region %s: %s", self.path, self.layout.describe())
        return True

    def _join(self, fd: int, timeout_s: float) -> bool:
        """Map the region already at :attr:`path` (opened as ``fd``); False when it was stale and is removed.

        Stale: no process holds it (every process of the engine that made it
        is gone), its creator is gone, or it is empty or torn (left by an
        older kvtriton or another writer). It is replaced, never waited on.
        """
        self._fd = fd
        joined = False
        try:
            opened = os.fstat(fd)
            refuse_unless_private(self.path, opened)
            if nobody_holds(fd):
                self._remove_stale(opened, "no process maps it (the engine that made it is gone)")
                return False
            hold_shared(fd, self.path, timeout_s)
            opened = os.fstat(fd)
            if opened.st_nlink == 0:
                return False  # removed as stale while this process waited for its lock
            header = os.pread(fd, HEADER_BYTES, 0)
            if opened.st_size < HEADER_BYTES or not header.startswith(MAGIC):
                self._remove_stale(opened, f"it is empty or torn ({opened.st_size} bytes, no kvtriton header)")
                return False
            creator = CREATOR.read(header)
            if not process_alive(creator):
                self._remove_stale(opened, f"its creator, pid {creator}, is gone")
                return False
            if opened.st_size != self.file_bytes:
                raise ValueError(
                    f"{self.path} holds {opened.st_size} bytes laid out as {self._read_layout()}, but this process "
                    f"expects {self.file_bytes} bytes laid out as {self.layout.describe()}: every rank must hold the "
                    "same KV bytes per block (split the layers evenly over pipeline stages: VLLM_PP_LAYER_PARTITION) "
                    "and use the same cpu_bytes_to_use and block size"
                )
            self._mmap = mmap.mmap(fd, self.file_bytes, flags=mmap.MAP_SHARED)
            theirs = self._read_layout()
            if theirs != self.layout.describe():
                raise ValueError(
                    f"{self.path} is laid out as {theirs}, but this process expects {self.layout.describe()}: every "
                    f"rank must hold the same KV bytes per block (split the layers evenly over pipeline stages: "
                    f"VLLM_PP_LAYER_PARTITION) and use the same cpu_bytes_to_use and block size"
                )
            self._file = opened
            joined = True
        finally:
            if not joined:
                self._close_mapping()
        logger.info("joined shared host region %s", self.path)
        return True

    def _remove_stale(self, opened: os.stat_result, why: str) -> None:
        """Remove the stale file at :attr:`path` (when it is still the one opened), saying why."""
        if is_same_file(self.path, opened):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            logger.warning("replaced the shared host region %s: %s", self.path, why)

    def _read_layout(self) -> str:
        """The creator's layout, described as :meth:`RegionLayout.describe` does."""
        header = os.pread(self._fd, HEADER_BYTES, 0)
        length = LAYOUT_LENGTH.read(header)
        try:
            fields = json.loads(header[LAYOUT_AT : LAYOUT_AT + length])
            return RegionLayout(**fields).describe()
        except (ValueError, TypeError) as error:
            return f"an unreadable header ({error})"

    def _register_mapping(self) -> None:
        """Count this process in; the one that completes the count unlinks the file."""
        try:
            count = self._add_one(MAPPED)
            if count >= self._expected:
                self._unlink()
                logger.info("all %d processes mapped %s: unlinked it", count, self.path)
        except BaseException:
            self._close_mapping()
            raise

    def _add_one(self, counter: HeaderField) -> int:
        """Add one to a header counter under the header lock (every mapper may write it at once); the new value."""
        region = self._require_mapping()
        with header_locked(self._fd):
            count = counter.read(region) + 1
            counter.write(region, count)
            return count

    def _unlink(self) -> None:
        """Remove the file's name, unless it names another file by now (this one was replaced as stale)."""
        if not self._unlinked:
            if self._file is not None and is_same_file(self.path, self._file):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            self._unlinked = True

    def _require_mapping(self) -> mmap.mmap:
        if self._mmap is None:
            raise RuntimeError(f"the shared host region {self.path} is closed")
        return self._mmap

    # --- views ----------------------------------------------------------

    @property
    def unlinked(self) -> bool:
        """Whether this process removed the file name (every expected process had mapped it, or close() ran)."""
        return self._unlinked

    def _read_count(self, counter: HeaderField) -> int:
        return counter.read(self._require_mapping())

    @property
    def mapped_count(self) -> int:
        """How many processes have mapped the region so far."""
        return self._read_count(MAPPED)

    @property
    def populated_count(self) -> int:
        """How many worker ranks have populated their bytes so far (:meth:`rank_slab`); pinning waits for all."""
        return self._read_count(POPULATED)

    def _wait_for_every_rank(self, rank: int, timeout_s: float) -> None:
        """Block until every rank has populated its bytes; ``TimeoutError`` naming how many did, after ``timeout_s``."""
        self._wait_for_count(POPULATED, rank, timeout_s, "populate its bytes of", " before pinning")

    def _wait_for_count(self, counter: HeaderField, rank: int, timeout_s: float, what: str, why: str) -> None:
        """Block until ``counter`` reaches ``world_size``; ``TimeoutError`` naming how many ranks did, after ``timeout_s``."""
        world = self.layout.world_size
        deadline = time.monotonic() + timeout_s
        started = time.perf_counter()
        while (arrived := self._read_count(counter)) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {rank} waited {timeout_s} s for every rank to {what} {self.path}{why}, but only "
                    f"{arrived} of {world} did: a rank that never takes its slab (it failed or never started: see its "
                    f"log) holds the others here; raise populate_timeout_s if ranks are only slow to start"
                )
            time.sleep(_POLL_S)
        logger.info(
            "rank %d: all %d ranks %s %s after %.3f s", rank, world, what, self.path, time.perf_counter() - started
        )

    def _report_pinning(self, rank: int, refusal: PinRefusal | None) -> None:
        """Count how ``rank``'s pinning went in the header (a rank once; a refusal once), under the header lock."""
        region = self._require_mapping()
        with header_locked(self._fd):
            if rank not in self._reported_ranks:
                PIN_REPORTED.write(region, PIN_REPORTED.read(region) + 1)
                self._reported_ranks.add(rank)
            if refusal is not None and rank not in self._refused_ranks:
                PIN_REFUSED.write(region, PIN_REFUSED.read(region) + 1)
                self._refused_ranks.add(rank)
                if FIRST_REFUSAL.read(region) == 0:
                    FIRST_REFUSAL.write(region, (rank + 1) | refusal.code << 32)

    def _record_path(self, path: HostMemoryPath) -> None:
        """Keep the slowest path any rank took in the header (the gauge reports the engine's slowest rank)."""
        region = self._require_mapping()
        with header_locked(self._fd):
            MEMORY_PATH.write(region, max(MEMORY_PATH.read(region), int(path) + 1))

    @property
    def memory_path(self) -> HostMemoryPath | None:
        """The host memory the ranks' copies go through (the slowest rank's); None before any rank took its slab.

        Read from the header, so the scheduler process, which never pins,
        reports it too (the value of kvtriton's host memory path gauge).
        """
        recorded = self._read_count(MEMORY_PATH)
        return None if recorded == 0 else HostMemoryPath(recorded - 1)

    @property
    def refused_count(self) -> int:
        """How many ranks CUDA refused to pin their view of the region (any one sends every rank to pageable)."""
        return self._read_count(PIN_REFUSED)

    def _bytes(self) -> torch.Tensor:
        """The whole file as a uint8 tensor sharing the mapping."""
        tensor = torch.frombuffer(self._require_mapping(), dtype=torch.uint8)
        self._tensors.append(tensor)
        return tensor

    def region_tensor(self) -> torch.Tensor:
        """The rows (header excluded) as a ``(num_chunks, chunk_bytes)`` uint8 tensor sharing the mapping."""
        layout = self.layout
        return self._bytes()[HEADER_BYTES:].view(layout.num_chunks, layout.chunk_bytes)

    def rank_rows(self, rank: int) -> torch.Tensor:
        """``rank``'s bytes of every block row: a ``(num_block_rows, rank_row_bytes)`` strided uint8 view.

        Block row ``s * block_size_factor + i`` is block ``i`` of chunk ``s``,
        the row numbering of a slab with the same ``block_size_factor``.
        """
        layout = self.layout
        return torch.as_strided(
            self._bytes(),
            (layout.num_block_rows, layout.rank_row_bytes),
            (layout.block_row_stride, 1),
            HEADER_BYTES + layout.rank_offset(rank),
        )

    def rank_slab(
        self,
        rank: int,
        *,
        pin: bool | None = None,
        allow_pageable: bool = False,
        gpu: int | None = None,
        populate_timeout_s: float = POPULATE_TIMEOUT_S,
    ) -> HostSlab:
        """``rank``'s :class:`HostSlab` over the region: the rows of :meth:`rank_rows`, one slot per chunk.

        First populates the pages holding ``rank``'s bytes (on the CPUs of
        ``gpu``'s NUMA node when the slab is pinned: default the current CUDA
        device, see :mod:`kvtriton.worker._numa`) and counts the rank in the
        header. A slab that will be pinned then waits until every rank has
        done so (at most ``populate_timeout_s`` seconds, then ``TimeoutError``
        naming how many ranks arrived; nothing is pinned), registers every
        whole block row (:meth:`HostSlab.register`), counts how that went in
        the header and waits until every rank has too (the same timeout): if
        CUDA refused any rank, every rank's slab is pageable (see the module
        docstring; one WARNING for the engine). ``pin`` and ``gpu`` work as
        for :meth:`HostSlab.from_buffer`; ``allow_pageable`` (the slab
        opener's signature) changes nothing here: a refused registration
        always leads to pageable memory, the region having no other. Closing
        the slab unpins it and leaves the mapping to this region.
        """
        layout = self.layout
        layout.rank_offset(rank)  # validates rank before any work
        if (
            isinstance(populate_timeout_s, bool)
            or not isinstance(populate_timeout_s, (int, float))  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers
            or not populate_timeout_s >= 0
        ):
            raise ValueError(f"populate_timeout_s must be a number of seconds >= 0, got {populate_timeout_s!r}")
        pinning = HostSlab.will_pin(pin, allow_pageable, gpu)  # bad arguments raise here, before any work
        region = self._require_mapping()
        placed_on = placement_gpu(gpu) if pin is not False or gpu is not None else None
        started = time.perf_counter()
        with on_gpu_node(placed_on) as node:
            try:
                _populate_rank(region, self._fd, layout, rank)
            except OSError as error:
                raise OSError(
                    error.errno,
                    f"rank {rank} could not allocate its {layout.num_block_rows * layout.rank_row_bytes} bytes of "
                    f"{self.path} ({error.strerror}): {os.path.dirname(self.path)} filled up after the region was "
                    "sized; free it (kvtriton removes its own stale regions at start) or lower cpu_bytes_to_use",
                ) from error
        logger.info(
            "populated rank %d's bytes of %s in %.3f s%s",
            rank,
            self.path,
            time.perf_counter() - started,
            "" if node is None else f" on NUMA node {node}",
        )
        if rank not in self._populated_ranks:  # a second slab of the same rank counts once
            self._add_one(POPULATED)
            self._populated_ranks.add(rank)
        if pinning:
            self._wait_for_every_rank(rank, populate_timeout_s)
        slab = HostSlab.from_buffer(
            self.region_tensor().reshape(-1),
            layout.num_chunks,
            layout.block_size_factor,
            layout.rank_row_bytes,
            row_stride=layout.block_row_stride,
            row_offset=layout.rank_offset(rank),
            pin=pin if not pinning else False,  # a pinning rank registers below, and agrees with the others
            allow_pageable=allow_pageable,
            gpu=gpu,
        )
        try:
            if not pinning:
                self._report_pinning(rank, None)
                self._record_path(HostMemoryPath.PAGEABLE)
                return slab
            self._report_pinning(rank, slab.register(gpu))
            self._wait_for_count(PIN_REPORTED, rank, populate_timeout_s, "say how pinning went for", "")
            self._agree_on_path(rank, slab)
        except BaseException:
            slab.close()
            raise
        return slab

    def _agree_on_path(self, rank: int, slab: HostSlab) -> None:
        """Take the path every rank takes: pinned unless CUDA refused some rank, then pageable for all (one WARNING).

        Every rank has reported (pinned or refused) before this runs, so all
        read the same counts. The first refused rank logs the engine's one
        WARNING; the others say what they follow at INFO.
        """
        refused = self.refused_count
        if refused == 0:
            self._record_path(slab.memory_path)
            return
        slab.unregister()
        self._record_path(HostMemoryPath.PAGEABLE)
        first = self._read_count(FIRST_REFUSAL)
        first_rank, code = (first & 0xFFFFFFFF) - 1, first >> 32
        if rank != first_rank:
            logger.info(
                "rank %d: CUDA refused to pin rank %d's view of %s: this rank copies through %s too",
                rank,
                first_rank,
                self.path,
                HostMemoryPath.PAGEABLE.description,
            )
            return
        logger.warning(
            "CUDA refused to pin the shared host region %s for %d of %d rank(s) (cudaHostRegister failed with %s, "
            "first on rank %d; a GPU in confidential-computing mode refuses every registration, a driver or "
            "container may cap it): every rank copies through %s instead (host memory path %d); it costs "
            "bandwidth: the driver stages each copy through its own pinned buffers, so a transfer holds a copy "
            "thread for its whole length and moves at a fraction of the pinned rate",
            self.path,
            refused,
            self.layout.world_size,
            error_name(code),
            first_rank,
            HostMemoryPath.PAGEABLE.description,
            HostMemoryPath.PAGEABLE,
        )

    def chunk_memoryview(self) -> memoryview:
        """The chunks as a ``(num_chunks, chunk_bytes)`` memoryview: what vLLM's secondary tiers copy from and to."""
        layout = self.layout
        flat = memoryview(self._require_mapping())[HEADER_BYTES:]
        view = flat.cast("B", (layout.num_chunks, layout.chunk_bytes))
        self._views.extend((flat, view))
        return view

    def close(self) -> None:
        """Drop this process's mapping (once every view is gone) and unlink the file if no one did; idempotent."""
        self._unlink()
        self._close_mapping()

    def _close_mapping(self) -> None:
        for view in reversed(self._views):
            view.release()
        self._views.clear()
        self._tensors.clear()
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A view handed out earlier is still alive somewhere (a tier's
                # memoryview, a tensor): unmapping would pull memory from under
                # it. The mapping goes when its last user does.
                logger.debug("%s stays mapped until its last view is dropped", self.path)
            self._mmap = None
        if self._fd >= 0:
            close_region_fd(self._fd)  # the shared lock stays while the mapping does (it holds the open file)
            self._fd = -1

    def __repr__(self) -> str:
        state = "closed" if self._mmap is None else ("unlinked" if self._unlinked else "linked")
        return f"SharedRegion({self.path!r}, {self.layout.describe()}, {state})"
