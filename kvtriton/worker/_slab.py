"""HostSlab: the packed host buffer that offloaded KV blocks live in.

``num_slots * block_size_factor`` rows of ``row_bytes`` bytes; slot ``s`` is
rows ``s*f .. s*f+f-1`` with ``f = block_size_factor`` (vLLM's
``blocks_per_chunk``: one slot holds that many GPU blocks).

Where the memory comes from:

* ``HostSlab(...)`` allocates it: an anonymous private ``mmap``, so it starts
  on a page boundary and the tensor's storage starts exactly where the first
  registration does (``Tensor.is_pinned()`` asks CUDA about the *storage's*
  first byte, so rows carved out of a larger torch allocation would read as
  pageable even when every row is registered).
* ``HostSlab.from_buffer(...)`` adopts memory created elsewhere (an ``mmap``
  of a ``/dev/shm`` file shared by several ranks, say). It never unmaps it.
  With ``row_stride`` and ``row_offset`` the slab is one rank's strided view:
  every shared row is ``row_stride`` bytes and this rank's ``row_bytes`` start
  ``row_offset`` bytes into it.

Pinning: with CUDA the memory is registered with ``cudaHostRegister`` chunk
by chunk (one huge registration is slow or fails on some systems), and every
chunk ends on a slot boundary that is also a host page boundary, so no slot
straddles two registrations and no two registrations share a page. A strided
view registers every whole shared row it spans: the padding between its rows
and, in a region shared by several ranks, the other ranks' bytes of those rows
too. Its own rows sit a shared row apart (the kernels address rows with one
stride, and vLLM's tiers need each chunk's bytes contiguous), so registering
them alone costs one ``cudaHostRegister`` per row (tens of thousands for a
100 GB region) where whole rows take one per :data:`PIN_CHUNK_BYTES`. Every
chunk holds the same number of rows (:attr:`HostSlab.registration_rows`, the
last one fewer): a run of consecutive rows may still cross a chunk boundary,
so the copy backends cut runs there (one DMA may not span two registrations).
At pin time every chunk's device address is checked to equal its host
address (:attr:`HostSlab.device_aliased`), which the Triton path relies on:
the kernel reaches every row as the slab's base plus an offset.

The pages are first touched by the pinning, on the CPUs of the GPU's NUMA
node (:mod:`kvtriton.worker._numa`), so they live next to the GPU that copies
them. An allocated slab is also marked ``MADV_DONTFORK``: a child process
forked later (a tokenizer pool, say) must not turn the pinned pages
copy-on-write, after which the process's writes would go to fresh pages the
GPU never sees.

When the driver refuses to register a slab's own memory (a GPU in
confidential-computing mode refuses every size with ``cudaErrorNotSupported``;
a driver's size cap; a container's limits) the slab takes pinned memory the
driver allocates instead (``cudaHostAlloc``, which confidential computing
allows) with one WARNING, and its copies run as fast
(:attr:`HostSlab.memory_path` is :attr:`HostMemoryPath.HOST_ALLOC`). Adopted
memory cannot be replaced so: :meth:`HostSlab.register` reports the refusal
to the memory's owner instead (a shared region decides with every rank, see
:mod:`kvtriton.worker._shared_region`).

When pinning fails anyway (``cudaHostAlloc`` refused too: out of RAM, say)
the slab raises :class:`SlabPinningError`, one line naming the CUDA errors,
the bytes asked for and the RAM available, unless the caller opted into a
pageable slab with ``allow_pageable=True`` (then a
:class:`PageableSlabWarning` says so). ``RLIMIT_MEMLOCK`` is named for
information only: the NVIDIA driver pins registered memory with
``pin_user_pages`` and never charges it to the locked-memory limit, so the
limit neither allows nor refuses a pin, and nothing here skips pinning for it.

Lifetime: transfer engines register themselves as users of the slab
(:meth:`HostSlab.add_user`); :meth:`HostSlab.close` drains every live user's
streams before it unregisters the memory, so no queued copy ever touches
memory that is no longer pinned. Memory from ``cudaHostAlloc`` is freed when
no view of it remains.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import math
import mmap
import os
import resource
import warnings
import weakref
from dataclasses import dataclass
from typing import Protocol, SupportsInt, cast

import torch

from kvtriton._int_argument import check_int
from kvtriton.worker._closing import ClosesOnExit
from kvtriton.worker._cudart import (
    CudaRuntimeError,
    error_name,
    free_host,
    host_alloc,
    host_device_pointer,
    last_error,
    loaded_cudart,
)
from kvtriton.worker._numa import on_gpu_node, placement_gpu

logger = logging.getLogger(__name__)

PIN_CHUNK_BYTES = 1 << 30
"""Bytes pinned per cudaHostRegister call, about (large single registrations are slow or fail).

Rounded to whole slots that end on a host page boundary, see :func:`pin_ranges`.
"""

HOST_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
"""The host page size: the slab starts on a page boundary."""

MEMLOCK_NOTE = (
    "for information: the NVIDIA driver does not charge cudaHostRegister to it, so it neither allows nor stops a pin"
)
"""What every mention of RLIMIT_MEMLOCK adds (the slab's failure message, ``kvtriton info``)."""


class HostMemoryPath(enum.IntEnum):
    """Which host memory the copies of a slab (or of a shared region's ranks) go through; the value is the gauge's.

    Ordered from the fastest: where ranks differ, the slowest one's path is the engine's.
    """

    REGISTERED = 0
    """Pinned in place: ``cudaHostRegister`` accepted the memory; copies run at full speed."""
    HOST_ALLOC = 1
    """Registration was refused; pinned memory from ``cudaHostAlloc`` instead: copies run at full speed."""
    PAGEABLE = 2
    """Not pinned: the ``dma`` backend copies on the engine's copy threads, the driver staging every copy."""

    @property
    def description(self) -> str:
        """What the path is, for a log line: ``"pageable memory (...)"``."""
        return _PATH_DESCRIPTIONS[self]


_PATH_DESCRIPTIONS = {
    HostMemoryPath.REGISTERED: "pinned memory (cudaHostRegister)",
    HostMemoryPath.HOST_ALLOC: "pinned memory from cudaHostAlloc",
    HostMemoryPath.PAGEABLE: "pageable memory (dma backend on copy threads)",
}


@dataclass(frozen=True, slots=True)
class PinRefusal:
    """Why CUDA refused to pin a slab's memory (nothing of it stays registered)."""

    code: int
    """The CUDA error ``cudaHostRegister`` returned (801, ``cudaErrorNotSupported``, in confidential computing)."""
    detail: str
    """``cudaHostRegister failed with <name> (<code>) on bytes <a>..<b>``, and any fallback that failed too."""
    nbytes: int
    """The bytes the slab asked to pin."""

    def message(self) -> str:
        """The one-line failure :class:`SlabPinningError` and :class:`PageableSlabWarning` carry."""
        return _pin_failure(self.nbytes, self.detail)


class PageableSlabWarning(UserWarning):
    """The slab is not pinned: transfers work but host copies are slower and synchronous."""


class SlabPinningError(RuntimeError):
    """The slab could not be pinned and the caller did not allow a pageable slab."""


class SlabUser(Protocol):
    """Something that queues copies touching the slab (a transfer engine)."""

    def drain(self) -> None:
        """Wait until no queued copy touches the slab any more."""
        ...


class _HostRegistrar(Protocol):
    """The CUDA runtime calls the slab needs."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> SupportsInt: ...  # noqa: N802 -- the CUDA name

    def cudaHostUnregister(self, ptr: int) -> SupportsInt: ...  # noqa: N802 -- the CUDA name

    def cudaGetLastError(self) -> SupportsInt: ...  # noqa: N802 -- the CUDA name


class _CudaRuntime:
    """``torch.cuda.cudart()``'s register calls, plus ``cudaGetLastError`` from the loaded libcudart.

    A failing runtime call also sets the runtime's per-thread last error, which
    torch reads after its next kernel launch and would report there, far from
    the cause; torch binds no ``cudaGetLastError``, so it is taken from the
    libcudart this process already loaded (as vLLM does).
    """

    def __init__(self) -> None:
        self._torch = cast(_HostRegistrar, torch.cuda.cudart())

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> SupportsInt:  # noqa: N802 -- the CUDA name
        return self._torch.cudaHostRegister(ptr, size, flags)

    def cudaHostUnregister(self, ptr: int) -> SupportsInt:  # noqa: N802 -- the CUDA name
        return self._torch.cudaHostUnregister(ptr)

    def cudaGetLastError(self) -> SupportsInt:  # noqa: N802 -- the CUDA name
        if loaded_cudart() is None:
            logger.warning("libcudart is not loaded in this process; a failed CUDA call may surface at a later launch")
        return last_error()


class _HostAllocator(Protocol):
    """``cudaHostAlloc`` and ``cudaFreeHost``: where a slab's own memory could not be registered."""

    def host_alloc(self, nbytes: int) -> tuple[int, int]:
        """``(error code, address)``; the address is 0 unless the code is 0."""
        ...

    def free_host(self, pointer: int) -> int:
        """The error code of freeing what :meth:`host_alloc` gave (0: freed)."""
        ...


class _CudaHostAllocator:
    """The loaded libcudart's ``cudaHostAlloc`` and ``cudaFreeHost`` (:mod:`kvtriton.worker._cudart`)."""

    def host_alloc(self, nbytes: int) -> tuple[int, int]:
        return host_alloc(nbytes)

    def free_host(self, pointer: int) -> int:
        return free_host(pointer)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _registrar() -> _HostRegistrar:
    return _CudaRuntime()


def _host_allocator() -> _HostAllocator | None:
    """The runtime's host allocator; None where libcudart is not loaded (torch binds no ``cudaHostAlloc``)."""
    return _CudaHostAllocator() if loaded_cudart() is not None else None


def _free_host_memory(allocator: _HostAllocator, pointer: int) -> None:
    """Free a slab's ``cudaHostAlloc`` memory once no view of it remains (a finaliser: it never raises)."""
    code = allocator.free_host(pointer)
    if code != 0:
        logger.warning(
            "cudaFreeHost(%#x) failed with %s: the host slab's memory stays allocated", pointer, error_name(code)
        )


def _device_pointer(host: int) -> int | None:
    """Where the device reaches registered host memory at ``host`` (None: libcudart not loaded, cannot tell).

    A failing query reads as "somewhere else" (0): the slab is then not used by
    the triton backend, which relies on the answer, and no registration leaks.
    """
    try:
        return host_device_pointer(host)
    except CudaRuntimeError as error:
        logger.warning("cannot tell where the device reaches the host slab at %#x: %s", host, error)
        return 0


_MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", 10)


def _page_aligned_zeros(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes whose storage starts on a host page boundary (an anonymous private mmap).

    The kernel zero-fills pages on first touch, so a large slab costs no upfront
    memset; the tensor keeps the mapping alive (``torch.frombuffer`` holds it).
    The mapping is ``MADV_DONTFORK`` (see the module docstring).
    """
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    try:
        buffer.madvise(_MADV_DONTFORK)
    except OSError as error:  # not fatal: only a later fork() would be
        logger.warning("madvise(MADV_DONTFORK) on the host slab failed: %s", error)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def mem_available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes, or None where the file is missing."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memlock_limit_bytes() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes, or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _check_sizes(num_slots: int, block_size_factor: int, row_bytes: int) -> None:
    check_int("num_slots", num_slots, minimum=1)
    check_int("block_size_factor", block_size_factor, minimum=1)
    check_int("row_bytes", row_bytes, minimum=1)


def _flat_bytes(buffer: torch.Tensor | mmap.mmap | bytearray | memoryview) -> torch.Tensor:
    """``buffer`` as a 1-D uint8 CPU tensor sharing its memory."""
    if isinstance(buffer, torch.Tensor):
        if (
            buffer.device.type != "cpu"
            or buffer.dtype != torch.uint8
            or buffer.dim() != 1
            or not buffer.is_contiguous()
        ):
            raise ValueError(
                f"buffer must be a contiguous 1-D uint8 CPU tensor, got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}"
            )
        return buffer
    if isinstance(buffer, memoryview) and buffer.readonly:
        raise ValueError("buffer is read-only; the slab writes into it")
    if isinstance(buffer, (mmap.mmap, bytearray, memoryview)):  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers
        with warnings.catch_warnings():
            # frombuffer warns on read-only buffers; a read-only mmap fails on first write instead.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(buffer, dtype=torch.uint8)
    raise TypeError(f"buffer must be an mmap, bytearray, memoryview or uint8 tensor, got {type(buffer).__name__}")


def pin_ranges(nbytes: int, slot_bytes: int, chunk_bytes: int, page_bytes: int) -> list[tuple[int, int]]:
    """``(offset, size)`` registrations covering ``nbytes`` from a page-aligned base.

    Every range but the last ends on a slot boundary (a multiple of
    ``slot_bytes``) that is also a page boundary, and holds about
    ``chunk_bytes`` (at least the smallest such span).
    """
    slots_per_aligned_step = page_bytes // math.gcd(slot_bytes, page_bytes)
    wanted_slots = max(1, chunk_bytes // slot_bytes)
    chunk_slots = max(1, wanted_slots // slots_per_aligned_step) * slots_per_aligned_step
    step = chunk_slots * slot_bytes
    return [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)]


def _pin_failure(nbytes: int, detail: str) -> str:
    available = mem_available_bytes()
    available_text = "MemAvailable is unknown" if available is None else f"MemAvailable is {available} bytes"
    limit = memlock_limit_bytes()
    limit_text = "unlimited" if limit is None else f"{limit} bytes"
    return (
        f"cannot pin the {nbytes}-byte host slab ({detail}); {available_text}: pinning needs that much free RAM "
        f"in this process's memory limit (a container's cgroup memory.max counts), so free RAM or use a smaller "
        f"slab; RLIMIT_MEMLOCK is {limit_text} ({MEMLOCK_NOTE}); or opt into a slower pageable slab "
        f"(allow_pageable=True)"
    )


class HostSlab(ClosesOnExit):
    """A packed, optionally pinned host buffer of ``num_slots`` slots of ``block_size_factor`` rows.

    ``pin=None`` pins when CUDA is available and stays pageable (one
    :class:`PageableSlabWarning`) when it is not; ``pin=True`` requires CUDA;
    ``pin=False`` never pins. A failed pin raises :class:`SlabPinningError`
    unless ``allow_pageable=True``, which keeps the slab pageable with a
    warning (transfers then take the ``dma`` backend). Use it as a context
    manager or call :meth:`close`.
    """

    def __init__(
        self,
        num_slots: int,
        block_size_factor: int,
        row_bytes: int,
        pin: bool | None = None,
        *,
        allow_pageable: bool = False,
        gpu: int | None = None,
    ) -> None:
        _check_sizes(num_slots, block_size_factor, row_bytes)
        nbytes = num_slots * block_size_factor * row_bytes
        available = mem_available_bytes()
        if available is not None and nbytes > available:
            raise ValueError(
                f"a slab of {num_slots} slots x {block_size_factor} rows x {row_bytes} bytes needs {nbytes} bytes, "
                f"but only {available} bytes of RAM are available (MemAvailable)"
            )
        flat = _page_aligned_zeros(nbytes)
        self._setup(flat, num_slots, block_size_factor, row_bytes, row_bytes, 0, owns_memory=True)
        self._pin_if_wanted(pin, allow_pageable, gpu)

    @classmethod
    def from_buffer(
        cls,
        buffer: torch.Tensor | mmap.mmap | bytearray | memoryview,
        num_slots: int,
        block_size_factor: int,
        row_bytes: int,
        *,
        row_stride: int | None = None,
        row_offset: int = 0,
        pin: bool | None = None,
        allow_pageable: bool = False,
        gpu: int | None = None,
    ) -> HostSlab:
        """A slab over host memory created elsewhere; :meth:`close` unpins it but never unmaps it.

        ``buffer`` is a writable buffer (an ``mmap``, say) or a 1-D uint8 CPU
        tensor. Row ``r`` of the slab is ``buffer[r*row_stride + row_offset :
        ... + row_bytes]``: with the defaults (``row_stride = row_bytes``,
        ``row_offset = 0``) the rows are packed; a per-rank view of a shared
        buffer passes the shared row stride and this rank's offset in a row.
        Pinning registers every whole shared row the slab spans, in
        slot- and page-aligned pieces (in this process's address space: the
        buffer must start on a host page boundary when it is pinned); a
        refused registration raises or warns as for an allocated slab, but
        never takes other memory (:meth:`register` reports it instead).
        """
        _check_sizes(num_slots, block_size_factor, row_bytes)
        stride = row_bytes if row_stride is None else row_stride
        check_int("row_stride", stride, minimum=1)
        check_int("row_offset", row_offset, minimum=0)
        if row_offset + row_bytes > stride:
            raise ValueError(
                f"row_offset {row_offset} + row_bytes {row_bytes} = {row_offset + row_bytes} does not fit in "
                f"row_stride {stride}: ranks' bytes would overlap the next row"
            )
        flat = _flat_bytes(buffer)
        num_rows = num_slots * block_size_factor
        needed = (num_rows - 1) * stride + row_offset + row_bytes
        if flat.numel() < needed:
            raise ValueError(
                f"buffer holds {flat.numel()} bytes but {num_slots} slots x {block_size_factor} rows of stride "
                f"{stride} (row_offset {row_offset}, row_bytes {row_bytes}) need {needed}"
            )
        slab = cls.__new__(cls)
        slab._setup(flat, num_slots, block_size_factor, row_bytes, stride, row_offset, owns_memory=False)
        slab._pin_if_wanted(pin, allow_pageable, gpu)
        return slab

    def _setup(
        self,
        flat: torch.Tensor,
        num_slots: int,
        block_size_factor: int,
        row_bytes: int,
        row_stride: int,
        row_offset: int,
        *,
        owns_memory: bool,
    ) -> None:
        self.num_slots = num_slots
        self.block_size_factor = block_size_factor
        self.row_bytes = row_bytes
        self.row_stride = row_stride
        self.row_offset = row_offset
        self.num_rows = num_slots * block_size_factor
        self.nbytes = self.num_rows * row_bytes
        self.owns_memory = owns_memory
        # Pinned span: every whole shared row the slab touches, clipped to the buffer.
        self._span_bytes = min(self.num_rows * row_stride, int(flat.numel()))
        self._flat: torch.Tensor | None = flat
        self._registered: list[int] = []
        self._host_allocated = False  # the memory came from cudaHostAlloc (its registration was refused)
        self.registration_rows: int | None = None
        """Rows per CUDA registration while pinned (the last registration may hold fewer); None when pageable."""
        self.device_aliased = True
        """Whether every registration is reached on the device at its host address (checked at pin time)."""
        self._users: list[weakref.ref[SlabUser]] = []
        self._rows: torch.Tensor | None = flat.as_strided(
            (self.num_rows, row_bytes), (row_stride, 1), flat.storage_offset() + row_offset
        )

    @staticmethod
    def will_pin(pin: bool | None, allow_pageable: bool = False, gpu: int | None = None) -> bool:
        """Whether a slab built with these arguments tries to pin (``ValueError``/``TypeError`` for bad ones).

        ``pin=None`` pins where CUDA is available. Raises what the constructor
        would, before anything is done: a caller that must prepare before a
        pin (a shared region waits for every rank) checks here first.
        """
        if pin is not None and not isinstance(pin, bool):  # pyright: ignore[reportUnnecessaryIsInstance] -- reject "yes" and 1
            raise TypeError(f"pin must be True, False or None, got {pin!r}")
        if not isinstance(allow_pageable, bool):  # pyright: ignore[reportUnnecessaryIsInstance] -- same
            raise TypeError(f"allow_pageable must be True or False, got {allow_pageable!r}")
        if gpu is not None:
            check_int("gpu", gpu, minimum=0)  # a CUDA device index
        if pin is True and not _cuda_available():
            raise ValueError("pin=True needs CUDA, but torch.cuda.is_available() is False; pass pin=None or False")
        return pin is True or (pin is None and _cuda_available())

    def _pin_if_wanted(self, pin: bool | None, allow_pageable: bool, gpu: int | None) -> None:
        if not self.will_pin(pin, allow_pageable, gpu):
            if pin is None:
                warnings.warn(
                    f"CUDA is not available: the {self.nbytes}-byte host slab stays pageable (not pinned)",
                    PageableSlabWarning,
                    stacklevel=3,
                )
            return
        with on_gpu_node(placement_gpu(gpu)) as node:
            refusal = self._register()
            if refusal is not None and self.owns_memory:
                refusal = self._take_host_memory(refusal)
        if refusal is not None:
            if not allow_pageable:
                raise SlabPinningError(refusal.message())
            warnings.warn(
                refusal.message() + "; allow_pageable=True: the slab stays pageable", PageableSlabWarning, stacklevel=3
            )
            return
        if node is not None:
            logger.info("host slab pages placed on NUMA node %d", node)

    def register(self, gpu: int | None = None) -> PinRefusal | None:
        """Pin this slab's memory where it lies (``cudaHostRegister``); None when pinned, else why CUDA refused.

        For a slab built unpinned over adopted memory whose owner decides what
        a refusal leads to (a shared region: every rank together). Pages are
        first touched on the CPUs of ``gpu``'s NUMA node (default the current
        CUDA device). After a refusal nothing stays registered, nothing is
        logged or warned, and the slab is pageable. ``ValueError`` when it is
        closed or already pinned.
        """
        if self.closed or self.pinned:
            raise ValueError(f"only an open, pageable slab can be registered; this one is {self!r}")
        if gpu is not None:
            check_int("gpu", gpu, minimum=0)
        with on_gpu_node(placement_gpu(gpu)):
            return self._register()

    def unregister(self) -> None:
        """Unpin memory :meth:`register` pinned (every rank of a shared region agreed to go pageable); idempotent.

        The caller makes sure no engine copies over it yet (the engines are
        built on what the slab is, pinned or not).
        """
        if self._host_allocated:
            raise ValueError("a slab on cudaHostAlloc memory cannot be unpinned; close it")
        self._unpin()

    @property
    def memory_path(self) -> HostMemoryPath:
        """Which memory this slab's copies go through (the gauge's value; see :class:`HostMemoryPath`)."""
        if self._host_allocated:
            return HostMemoryPath.HOST_ALLOC
        return HostMemoryPath.REGISTERED if self._registered else HostMemoryPath.PAGEABLE

    @classmethod
    def from_budget(
        cls,
        cpu_bytes_to_use: int,
        block_size_factor: int,
        row_bytes: int,
        *,
        world_size: int = 1,
        pin: bool | None = None,
        allow_pageable: bool = False,
        gpu: int | None = None,
    ) -> HostSlab:
        """A slab holding as many slots as this rank's share of ``cpu_bytes_to_use`` allows."""
        slots = cls.slots_for_budget(cpu_bytes_to_use, block_size_factor, row_bytes, world_size=world_size)
        return cls(slots, block_size_factor, row_bytes, pin=pin, allow_pageable=allow_pageable, gpu=gpu)

    @staticmethod
    def slots_for_budget(cpu_bytes_to_use: int, block_size_factor: int, row_bytes: int, *, world_size: int = 1) -> int:
        """How many slots fit in ``cpu_bytes_to_use`` split evenly over ``world_size`` ranks.

        Mirrors vLLM's ``cpu_bytes_to_use``: the budget is the total across
        ranks. Raises ``ValueError`` when not even one slot fits.
        """
        check_int("cpu_bytes_to_use", cpu_bytes_to_use, minimum=1)
        check_int("block_size_factor", block_size_factor, minimum=1)
        check_int("row_bytes", row_bytes, minimum=1)
        check_int("world_size", world_size, minimum=1)
        per_rank = cpu_bytes_to_use // world_size
        slot_bytes = block_size_factor * row_bytes
        slots = per_rank // slot_bytes
        if slots < 1:
            raise ValueError(
                f"cpu_bytes_to_use={cpu_bytes_to_use} over world_size={world_size} leaves {per_rank} bytes per rank, "
                f"less than one slot of {slot_bytes} bytes"
            )
        logger.info(
            "host slab budget: %d bytes over %d rank(s) = %d bytes per rank -> %d slots of %d bytes",
            cpu_bytes_to_use,
            world_size,
            per_rank,
            slots,
            slot_bytes,
        )
        return slots

    def _register(self) -> PinRefusal | None:
        """Register the slab's memory in :meth:`registration_plan`'s pieces; None when pinned, else why not.

        A refused piece unregisters the pieces before it and consumes the
        runtime's last error (so torch's next launch check does not report it).
        """
        flat = self._flat
        assert flat is not None
        base = flat.data_ptr()
        if base % HOST_PAGE_BYTES:
            raise ValueError(
                f"the buffer starts at {base:#x}, not on a {HOST_PAGE_BYTES}-byte host page boundary; "
                "pinning it would share a page with other registrations (map it with mmap, or pass pin=False)"
            )
        registrar = _registrar()
        ranges, rows_per_registration = self.registration_plan()
        pinned_bytes = sum(size for _, size in ranges)
        aliased = True
        for offset, size in ranges:
            code = int(registrar.cudaHostRegister(base + offset, size, 0))
            if code != 0:
                registrar.cudaGetLastError()  # consumed here, not by torch's next launch check
                self._unpin()
                return PinRefusal(
                    code,
                    f"cudaHostRegister failed with {error_name(code)} on bytes {offset}..{offset + size}",
                    pinned_bytes,
                )
            self._registered.append(base + offset)
            aliased &= self._reached_at_host_address(base + offset)
        self.device_aliased = aliased
        self.registration_rows = rows_per_registration
        logger.info("pinned %d bytes of host slab in %d registration(s)", pinned_bytes, len(self._registered))
        return None

    def _reached_at_host_address(self, host: int) -> bool:
        """Whether the device reaches pinned memory at ``host`` there too (a warning when not)."""
        device = _device_pointer(host)
        if device is None or device == host:
            return True
        logger.warning(
            "the host slab's pinned memory at %#x is reached on the device at %#x: the triton backend "
            "(which addresses every row from the slab's base) is refused for it; dma copies it",
            host,
            device,
        )
        return False

    def _take_host_memory(self, refusal: PinRefusal) -> PinRefusal | None:
        """Move this (new, empty) slab onto pinned memory from ``cudaHostAlloc``; None when done, else why not.

        Only for memory the slab allocated itself, before anyone saw it: its
        mapping is simply dropped. ``cudaHostAlloc`` memory is not zeroed
        (no slot is read before it is written) and is freed when no view of it
        remains. Says so in one WARNING: what was refused, what is used
        instead, what it costs.
        """
        allocator = _host_allocator()
        if allocator is None:
            return PinRefusal(
                refusal.code, f"{refusal.detail}; no cudaHostAlloc (libcudart is not loaded)", refusal.nbytes
            )
        code, pointer = allocator.host_alloc(self.nbytes)
        if code != 0:
            return PinRefusal(
                refusal.code, f"{refusal.detail}; cudaHostAlloc failed too with {error_name(code)}", refusal.nbytes
            )
        memory = (ctypes.c_ubyte * self.nbytes).from_address(pointer)
        # Not at exit: the process's memory goes with it, and CUDA may be torn down by then.
        weakref.finalize(memory, _free_host_memory, allocator, pointer).atexit = False
        flat = torch.frombuffer(memory, dtype=torch.uint8)  # holds ``memory``: freed with the last view
        self._setup(flat, self.num_slots, self.block_size_factor, self.row_bytes, self.row_bytes, 0, owns_memory=True)
        self._host_allocated = True
        self.device_aliased = self._reached_at_host_address(pointer)
        self.registration_rows = self.num_rows  # one allocation: no copy crosses a registration's end
        logger.warning(
            "CUDA refused to register the %d-byte host slab (%s; a GPU in confidential-computing mode refuses every "
            "registration): using %s instead (host memory path %d), copies run at full speed; it costs nothing but "
            "the lazy first touch: all %d bytes are allocated and pinned now",
            self.nbytes,
            refusal.detail,
            HostMemoryPath.HOST_ALLOC.description,
            HostMemoryPath.HOST_ALLOC,
            self.nbytes,
        )
        return None

    def registration_plan(self) -> tuple[list[tuple[int, int]], int]:
        """How pinning registers the slab: ``(offset, size)`` ranges from the buffer's start, and the rows per
        registration (:attr:`registration_rows` once pinned).

        Every whole shared row the slab spans, in slot- and page-aligned pieces
        of about :data:`PIN_CHUNK_BYTES` (:func:`pin_ranges`): the fewest
        registrations, whatever lies between this view's rows (padding, other
        ranks' bytes).
        """
        slot_bytes = self.block_size_factor * self.row_stride
        ranges = pin_ranges(self._span_bytes, slot_bytes, PIN_CHUNK_BYTES, HOST_PAGE_BYTES)
        # Every registration but the last holds the same whole slots (pin_ranges' step).
        return ranges, self.num_rows if len(ranges) == 1 else ranges[0][1] // self.row_stride

    def _unpin(self) -> None:
        if not self._registered:
            return
        registrar = _registrar()
        for pointer in self._registered:
            code = int(registrar.cudaHostUnregister(pointer))
            if code != 0:
                registrar.cudaGetLastError()
                logger.warning("cudaHostUnregister(%#x) failed with %s", pointer, error_name(code))
        self._registered.clear()
        self.registration_rows = None

    def add_user(self, user: SlabUser) -> None:
        """Have :meth:`close` call ``user.drain()`` first (held weakly: a collected user drains itself)."""
        self._users = [ref for ref in self._users if ref() is not None]
        self._users.append(weakref.ref(user))

    @property
    def rows(self) -> torch.Tensor:
        """The ``(num_slots * block_size_factor, row_bytes)`` uint8 rows (strided when ``row_stride > row_bytes``)."""
        if self._rows is None:
            raise RuntimeError("the host slab is closed")
        return self._rows

    @property
    def pinned(self) -> bool:
        """Whether the buffer is page-locked for CUDA: registered, or allocated by ``cudaHostAlloc``."""
        return bool(self._registered) or self._host_allocated

    @property
    def closed(self) -> bool:
        return self._rows is None

    def slot(self, slot: int) -> torch.Tensor:
        """The ``(block_size_factor, row_bytes)`` view of slot ``slot``."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in 0..{self.num_slots - 1}, got {slot}")
        return self.rows[slot * self.block_size_factor : (slot + 1) * self.block_size_factor]

    def close(self) -> None:
        """Drain the engines using the slab, unpin, drop the buffer; idempotent.

        Memory this slab allocated is freed once no view taken earlier holds
        it; memory adopted by :meth:`from_buffer` is left to its owner.
        """
        users, self._users = self._users, []
        for ref in users:
            user = ref()
            if user is not None:
                user.drain()
        self._unpin()
        self._host_allocated = False  # the memory itself goes with its last view
        self._rows = None
        self._flat = None

    def __del__(self) -> None:
        # Freeing registered memory without unregistering leaves a stale CUDA
        # registration behind, so a forgotten close() is done here.
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown may have torn down CUDA already
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("pinned" if self.pinned else "pageable")
        layout = (
            "" if self.row_stride == self.row_bytes else f", row_stride={self.row_stride}, row_offset={self.row_offset}"
        )
        return (
            f"HostSlab(num_slots={self.num_slots}, block_size_factor={self.block_size_factor}, "
            f"row_bytes={self.row_bytes}{layout}, {state})"
        )
