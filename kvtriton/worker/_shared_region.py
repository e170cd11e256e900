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
:mod:`kvtriton.integrations._vllm_tiering`).

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
the pages it shares with a rank still populating onto its own node. And each
rank pins its own part only, where the layout allows it (see
:func:`~kvtriton.worker._slab.own_row_ranges`), not world-size copies of the
whole region's pinning work. Pages no rank populated (padding) are faulted in
by the first process that touches them. Every process that has
mapped it adds one to a count in the region's header page; the process that
brings the count to ``expected_mappers`` unlinks the file. A file whose creator
no longer runs (an engine with the same id that died before every process had
mapped it) is removed and created afresh. From then on the
memory lives exactly as long as some process maps it: a crash leaks nothing in
/dev/shm. :meth:`SharedRegion.close` also unlinks it, for a process set that
never completed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import struct
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from numpy.typing import NDArray

from kvtriton._integrity import SEAL_BYTES
from kvtriton._region_rows import ROW_ALIGNMENT, block_row_stride
from kvtriton.worker._closing import ClosesOnExit
from kvtriton.worker._numa import on_gpu_node
from kvtriton.worker._slab import HostSlab, check_count


def _current_cuda_device() -> int | None:
    """The GPU whose NUMA node a rank's bytes are placed on by default (None without CUDA)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


logger = logging.getLogger(__name__)

REGION_DIRECTORY = "/dev/shm"
"""Where regions live: a tmpfs, so the memory is RAM and the file name is only a rendezvous."""

HEADER_BYTES = ROW_ALIGNMENT
"""The region starts with one header page (magic, mapper and populated counts, layout); rows follow, still aligned."""

_MAGIC = b"KVTRREG3"  # 3: the populated count joined the header
_COUNT = struct.Struct("<Q")  # processes that have mapped the region
_LENGTH = struct.Struct("<I")  # bytes of the layout JSON that follows
_PID = struct.Struct("<Q")  # the creator's process id: a region whose creator is gone is stale
_POPULATED = struct.Struct("<Q")  # worker ranks that have populated their bytes
_COUNT_AT = len(_MAGIC)
_PID_AT = _COUNT_AT + _COUNT.size
_POPULATED_AT = _PID_AT + _PID.size
_LENGTH_AT = _POPULATED_AT + _POPULATED.size
_JSON_AT = _LENGTH_AT + _LENGTH.size
JOIN_TIMEOUT_S = 30.0
"""How long a joining process waits for the creator to write the header (one page: no size makes it slow)."""
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
        check_count("num_chunks", self.num_chunks)
        check_count("block_size_factor", self.block_size_factor)
        check_count("world_size", self.world_size)
        check_count("rank_row_bytes", self.rank_row_bytes)

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
        check_count("cpu_bytes_to_use", cpu_bytes_to_use)
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


class _StaleRegion(Exception):
    """A region file whose creator no longer runs; it has been removed."""


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, under another user
    return True


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


def _populate_rank(region: mmap.mmap, layout: RegionLayout, rank: int) -> None:
    """Allocate the pages holding ``rank``'s bytes now, not on the first copy into them (a fault per page, mid-transfer).

    ``madvise(MADV_POPULATE_WRITE)`` per span of whole pages where the kernel
    has it (it never changes what the pages hold, so pages shared with another
    rank are safe); otherwise one write per page, of a byte of this rank's own
    (rewritten with its value: other ranks' bytes are never written).
    """
    starts = rank_row_starts(layout, rank)
    try:
        for offset, length in page_spans(starts, layout.rank_row_bytes):
            region.madvise(_MADV_POPULATE_WRITE, offset, length)
        return
    except OSError:
        pass  # Linux before 5.14: touch the pages one by one
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
        check_count("expected_mappers", expected_mappers)
        if not os.path.isdir(directory):
            raise ValueError(
                f"directory {directory!r} does not exist; the shared host region needs a tmpfs such as /dev/shm"
            )
        self.layout = layout
        self.path = os.path.join(directory, f"kvtriton_{name}.region")
        self.file_bytes = HEADER_BYTES + layout.region_bytes
        self._expected = expected_mappers
        self._unlinked = False
        self._mmap: mmap.mmap | None = None
        self._tensors: list[torch.Tensor] = []
        self._views: list[memoryview] = []
        self._fd = -1
        self._populated_ranks: set[int] = set()
        for attempt in range(2):
            try:
                self._fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                try:
                    self._join(join_timeout_s)
                except _StaleRegion:
                    if attempt == 0:
                        continue  # removed: create it afresh
                    raise
            else:
                self._create(directory)
            break
        self._register_mapping()

    # --- creation and joining -----------------------------------------

    def _create(self, directory: str) -> None:
        try:
            free = shm_free_bytes(directory)
            if self.file_bytes > free:
                raise ValueError(
                    f"{directory} has {free} bytes free but the shared host region needs {self.file_bytes} bytes "
                    f"({self.layout.describe()}); lower cpu_bytes_to_use or enlarge {directory} "
                    f"(docker: --shm-size; Kubernetes: an emptyDir with medium: Memory)"
                )
            os.ftruncate(self._fd, self.file_bytes)
            self._mmap = mmap.mmap(self._fd, self.file_bytes, flags=mmap.MAP_SHARED)
            # No pre-faulting here: joiners wait for the header only; ranks populate their own bytes (rank_slab).
            layout_json = json.dumps(asdict(self.layout), sort_keys=True).encode()
            if _JSON_AT + len(layout_json) > HEADER_BYTES:
                raise ValueError(
                    f"the region layout description ({len(layout_json)} bytes) does not fit the header page"
                )
            _PID.pack_into(self._mmap, _PID_AT, os.getpid())
            self._mmap[_LENGTH_AT:_JSON_AT] = _LENGTH.pack(len(layout_json))
            self._mmap[_JSON_AT : _JSON_AT + len(layout_json)] = layout_json
            # The magic goes last: joiners wait for it, so they never read a half-written header.
            self._mmap[: len(_MAGIC)] = _MAGIC
        except BaseException:
            self._unlink()
            self._close_mapping()
            raise
        logger.info("created shared host region %s: %s", self.path, self.layout.describe())

    def _join(self, timeout_s: float) -> None:
        self._fd = os.open(self.path, os.O_RDWR)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                stat = os.fstat(self._fd)
                if stat.st_size >= HEADER_BYTES and os.pread(self._fd, len(_MAGIC), 0) == _MAGIC:
                    break
                if stat.st_nlink == 0:
                    raise RuntimeError(f"the process creating {self.path} failed before finishing it; see its log")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.path} was not initialised within {timeout_s} s by the process creating it"
                    )
                time.sleep(_POLL_S)
            (creator,) = _PID.unpack(os.pread(self._fd, _PID.size, _PID_AT))
            if not _process_alive(int(creator)):
                # Left by an engine with the same id that died before every
                # process had mapped it (a fixed engine_id): start afresh.
                try:
                    if os.stat(self.path).st_ino == stat.st_ino:
                        os.unlink(self.path)
                except FileNotFoundError:
                    pass
                logger.warning(
                    "removed the stale shared host region %s (its creator, pid %d, is gone)", self.path, creator
                )
                raise _StaleRegion(self.path)
            if stat.st_size != self.file_bytes:
                theirs = self._read_layout()
                raise ValueError(
                    f"{self.path} holds {stat.st_size} bytes laid out as {theirs}, but this process expects "
                    f"{self.file_bytes} bytes laid out as {self.layout.describe()}: every rank must hold the same KV "
                    f"bytes per block (split the layers evenly over pipeline stages: VLLM_PP_LAYER_PARTITION) and "
                    f"use the same cpu_bytes_to_use and block size"
                )
            self._mmap = mmap.mmap(self._fd, self.file_bytes, flags=mmap.MAP_SHARED)
            theirs = self._read_layout()
            if theirs != self.layout.describe():
                raise ValueError(
                    f"{self.path} is laid out as {theirs}, but this process expects {self.layout.describe()}: every "
                    f"rank must hold the same KV bytes per block (split the layers evenly over pipeline stages: "
                    f"VLLM_PP_LAYER_PARTITION) and use the same cpu_bytes_to_use and block size"
                )
        except BaseException:
            self._close_mapping()
            raise
        logger.info("joined shared host region %s", self.path)

    def _read_layout(self) -> str:
        """The creator's layout, described as :meth:`RegionLayout.describe` does."""
        header = os.pread(self._fd, HEADER_BYTES, 0)
        (length,) = _LENGTH.unpack_from(header, _LENGTH_AT)
        try:
            fields = json.loads(header[_JSON_AT : _JSON_AT + length])
            return RegionLayout(**fields).describe()
        except (ValueError, TypeError) as error:
            return f"an unreadable header ({error})"

    def _register_mapping(self) -> None:
        """Count this process in; the one that completes the count unlinks the file."""
        try:
            count = self._add_one(_COUNT, _COUNT_AT)
            if count >= self._expected:
                self._unlink()
                logger.info("all %d processes mapped %s: unlinked it", count, self.path)
        except BaseException:
            self._close_mapping()
            raise

    def _add_one(self, counter: struct.Struct, at: int) -> int:
        """Add one to a header counter under the file lock (every mapper may write it at once); the new value."""
        region = self._require_mapping()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            (count,) = counter.unpack_from(region, at)
            counter.pack_into(region, at, count + 1)
            return int(count) + 1
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _unlink(self) -> None:
        if not self._unlinked:
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

    def _read_count(self, counter: struct.Struct, at: int) -> int:
        (count,) = counter.unpack_from(self._require_mapping(), at)
        return int(count)

    @property
    def mapped_count(self) -> int:
        """How many processes have mapped the region so far."""
        return self._read_count(_COUNT, _COUNT_AT)

    @property
    def populated_count(self) -> int:
        """How many worker ranks have populated their bytes so far (:meth:`rank_slab`); pinning waits for all."""
        return self._read_count(_POPULATED, _POPULATED_AT)

    def _wait_for_every_rank(self, rank: int, timeout_s: float) -> None:
        """Block until every rank has populated its bytes; ``TimeoutError`` naming how many did, after ``timeout_s``."""
        world = self.layout.world_size
        deadline = time.monotonic() + timeout_s
        started = time.perf_counter()
        while (populated := self.populated_count) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {rank} waited {timeout_s} s for every rank to populate its bytes of {self.path} before "
                    f"pinning, but only {populated} of {world} did: a rank that never takes its slab (it failed or "
                    f"never started: see its log) holds the others here; raise populate_timeout_s if ranks are "
                    f"only slow to start"
                )
            time.sleep(_POLL_S)
        logger.info(
            "rank %d: all %d ranks populated %s after %.3f s", rank, world, self.path, time.perf_counter() - started
        )

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
        naming how many ranks arrived; nothing is pinned). ``pin``,
        ``allow_pageable`` and ``gpu`` work as for
        :meth:`HostSlab.from_buffer`, which registers this rank's own pages
        where the layout allows it (the rows start on a page boundary, after
        the header page). Closing the slab unpins it and leaves the mapping
        to this region.
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
        placed_on = gpu if gpu is not None else (_current_cuda_device() if pin is not False else None)
        started = time.perf_counter()
        with on_gpu_node(placed_on) as node:
            _populate_rank(region, layout, rank)
        logger.info(
            "populated rank %d's bytes of %s in %.3f s%s", rank, self.path, time.perf_counter() - started,
            "" if node is None else f" on NUMA node {node}",
        )  # fmt: skip
        if rank not in self._populated_ranks:  # a second slab of the same rank counts once
            self._add_one(_POPULATED, _POPULATED_AT)
            self._populated_ranks.add(rank)
        if pinning:
            self._wait_for_every_rank(rank, populate_timeout_s)
        return HostSlab.from_buffer(
            self.region_tensor().reshape(-1),
            layout.num_chunks,
            layout.block_size_factor,
            layout.rank_row_bytes,
            row_stride=layout.block_row_stride,
            row_offset=layout.rank_offset(rank),
            pin=pin,
            allow_pageable=allow_pageable,
            gpu=gpu,
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
            os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        state = "closed" if self._mmap is None else ("unlinked" if self._unlinked else "linked")
        return f"SharedRegion({self.path!r}, {self.layout.describe()}, {state})"
