"""HostSlab: the packed host buffer that offloaded KV blocks live in.

One allocation of ``num_slots * rows_per_slot`` rows of ``row_bytes`` bytes;
slot ``s`` is rows ``s*f .. s*f+f-1`` with ``f = rows_per_slot``. With CUDA
the buffer is allocated pageable and then pinned chunk by chunk with
``cudaHostRegister``: torch's pinned allocator rounds every allocation up to a
power of two and a single large pin fails on some systems. Without CUDA the
slab stays pageable (one warning says so).

The buffer is an anonymous private ``mmap``: it starts on a page boundary (so
every registered chunk covers whole pages) and the tensor's storage starts
exactly where the registration does. ``Tensor.is_pinned()`` asks CUDA about
the *storage's* first byte, so a buffer carved out of a larger torch
allocation would read as pageable even when every row is registered.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import resource
import warnings
from types import TracebackType
from typing import Protocol, SupportsInt, cast

import torch

__all__ = ["HostSlab", "PageableSlabWarning"]

logger = logging.getLogger(__name__)

PIN_CHUNK_BYTES = 1 << 30
"""Bytes pinned per cudaHostRegister call (large single registrations are slow or fail); a page multiple."""

HOST_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
"""The host page size: the slab starts on a page boundary."""


class PageableSlabWarning(UserWarning):
    """The slab could not be pinned: transfers work but host copies are slower and synchronous."""


class _HostRegistrar(Protocol):
    """The CUDA runtime calls the slab needs."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> SupportsInt: ...

    def cudaHostUnregister(self, ptr: int) -> SupportsInt: ...

    def cudaGetLastError(self) -> SupportsInt: ...


class _CudaRuntime:
    """``torch.cuda.cudart()``'s register calls, plus ``cudaGetLastError`` from the loaded libcudart.

    A failing runtime call also sets the runtime's per-thread last error, which
    torch reads after its next kernel launch and would report there, far from
    the cause; torch binds no ``cudaGetLastError``, so it is taken from the
    libcudart this process already loaded (as vLLM does).
    """

    def __init__(self) -> None:
        self._torch = cast(_HostRegistrar, torch.cuda.cudart())

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> SupportsInt:
        return self._torch.cudaHostRegister(ptr, size, flags)

    def cudaHostUnregister(self, ptr: int) -> SupportsInt:
        return self._torch.cudaHostUnregister(ptr)

    def cudaGetLastError(self) -> SupportsInt:
        library = _loaded_cudart()
        if library is None:
            logger.warning("libcudart is not loaded in this process; a failed CUDA call may surface at a later launch")
            return 0
        return cast(int, library.cudaGetLastError())


def _loaded_cudart() -> ctypes.CDLL | None:
    """The libcudart shared library mapped into this process (torch's own copy), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = [line.split()[-1] for line in maps if "libcudart" in line]
    except OSError:
        return None
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _registrar() -> _HostRegistrar:
    return _CudaRuntime()


def _page_aligned_zeros(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes whose storage starts on a host page boundary (an anonymous private mmap).

    The kernel zero-fills pages on first touch, so a large slab costs no upfront
    memset; the tensor keeps the mapping alive (``torch.frombuffer`` holds it).
    """
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
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


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):  # pyright: ignore[reportUnnecessaryIsInstance] -- untyped callers pass floats
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


class HostSlab:
    """A packed, optionally pinned host buffer of ``num_slots`` slots of ``rows_per_slot`` rows.

    ``pin=None`` pins when CUDA is available and falls back to pageable memory
    with a :class:`PageableSlabWarning` otherwise (or when pinning fails);
    ``pin=True`` raises instead of falling back; ``pin=False`` never pins.
    Use it as a context manager or call :meth:`close` to unpin.
    """

    def __init__(self, num_slots: int, rows_per_slot: int, row_bytes: int, pin: bool | None = None) -> None:
        _check_count("num_slots", num_slots)
        _check_count("rows_per_slot", rows_per_slot)
        _check_count("row_bytes", row_bytes)
        if pin is not None and not isinstance(pin, bool):  # pyright: ignore[reportUnnecessaryIsInstance] -- reject "yes" and 1
            raise TypeError(f"pin must be True, False or None, got {pin!r}")
        nbytes = num_slots * rows_per_slot * row_bytes
        if pin is True and not _cuda_available():
            raise ValueError("pin=True needs CUDA, but torch.cuda.is_available() is False; pass pin=None or False")
        available = mem_available_bytes()
        if available is not None and nbytes > available:
            raise ValueError(
                f"a slab of {num_slots} slots x {rows_per_slot} rows x {row_bytes} bytes needs {nbytes} bytes, "
                f"but only {available} bytes of RAM are available (MemAvailable)"
            )
        want_pin = _cuda_available() if pin is None else pin
        if want_pin:
            limit = memlock_limit_bytes()
            if limit is not None and limit < nbytes:
                warnings.warn(
                    f"RLIMIT_MEMLOCK is {limit} bytes, below the {nbytes}-byte slab: pinning may fail "
                    "(raise it with `ulimit -l unlimited` or the container's memlock setting)",
                    PageableSlabWarning,
                    stacklevel=2,
                )
        self.num_slots = num_slots
        self.rows_per_slot = rows_per_slot
        self.row_bytes = row_bytes
        self.num_rows = num_slots * rows_per_slot
        self.nbytes = nbytes
        self._registered: list[int] = []
        # Page-aligned storage: every pinned chunk covers whole pages (two
        # registrations sharing a page fail), rows get the widest alignment, and
        # is_pinned() (which inspects the storage's first byte) sees the pin.
        self._rows: torch.Tensor | None = _page_aligned_zeros(nbytes).view(self.num_rows, row_bytes)
        if want_pin:
            self._pin(required=pin is True)
        elif pin is None:
            warnings.warn(
                f"CUDA is not available: the {nbytes}-byte host slab stays pageable (not pinned)",
                PageableSlabWarning,
                stacklevel=2,
            )

    @classmethod
    def from_budget(
        cls,
        cpu_bytes_to_use: int,
        rows_per_slot: int,
        row_bytes: int,
        *,
        world_size: int = 1,
        pin: bool | None = None,
    ) -> HostSlab:
        """A slab holding as many slots as this rank's share of ``cpu_bytes_to_use`` allows."""
        return cls(cls.slots_for_budget(cpu_bytes_to_use, rows_per_slot, row_bytes, world_size=world_size),
                   rows_per_slot, row_bytes, pin=pin)

    @staticmethod
    def slots_for_budget(cpu_bytes_to_use: int, rows_per_slot: int, row_bytes: int, *, world_size: int = 1) -> int:
        """How many slots fit in ``cpu_bytes_to_use`` split evenly over ``world_size`` ranks.

        Mirrors vLLM's ``cpu_bytes_to_use``: the budget is the total across
        ranks. Raises ``ValueError`` when not even one slot fits.
        """
        _check_count("cpu_bytes_to_use", cpu_bytes_to_use)
        _check_count("rows_per_slot", rows_per_slot)
        _check_count("row_bytes", row_bytes)
        _check_count("world_size", world_size)
        per_rank = cpu_bytes_to_use // world_size
        slot_bytes = rows_per_slot * row_bytes
        slots = per_rank // slot_bytes
        if slots < 1:
            raise ValueError(
                f"cpu_bytes_to_use={cpu_bytes_to_use} over world_size={world_size} leaves {per_rank} bytes per rank, "
                f"less than one slot of {slot_bytes} bytes"
            )
        logger.info(
            "host slab budget: %d bytes over %d rank(s) = %d bytes per rank -> %d slots of %d bytes",
            cpu_bytes_to_use, world_size, per_rank, slots, slot_bytes,
        )
        return slots

    def _pin(self, required: bool) -> None:
        rows = self.rows
        registrar = _registrar()
        base = rows.data_ptr()
        for offset in range(0, self.nbytes, PIN_CHUNK_BYTES):
            size = min(PIN_CHUNK_BYTES, self.nbytes - offset)
            code = int(registrar.cudaHostRegister(base + offset, size, 0))
            if code != 0:
                registrar.cudaGetLastError()  # consumed here, not by torch's next launch check
                self._unpin()
                message = (
                    f"cudaHostRegister failed with CUDA error {code} on bytes {offset}..{offset + size} "
                    f"of the {self.nbytes}-byte slab"
                )
                if required:
                    raise RuntimeError(message)
                warnings.warn(message + "; the slab stays pageable", PageableSlabWarning, stacklevel=3)
                return
            self._registered.append(base + offset)
        logger.info("pinned a %d-byte host slab in %d chunk(s)", self.nbytes, len(self._registered))

    def _unpin(self) -> None:
        if not self._registered:
            return
        registrar = _registrar()
        for pointer in self._registered:
            code = int(registrar.cudaHostUnregister(pointer))
            if code != 0:
                registrar.cudaGetLastError()
                logger.warning("cudaHostUnregister(%#x) failed with CUDA error %d", pointer, code)
        self._registered.clear()

    @property
    def rows(self) -> torch.Tensor:
        """The ``(num_slots * rows_per_slot, row_bytes)`` uint8 buffer."""
        if self._rows is None:
            raise RuntimeError("the host slab is closed")
        return self._rows

    @property
    def pinned(self) -> bool:
        """Whether the buffer is registered with CUDA (page-locked)."""
        return bool(self._registered)

    @property
    def closed(self) -> bool:
        return self._rows is None

    def slot(self, slot: int) -> torch.Tensor:
        """The ``(rows_per_slot, row_bytes)`` view of slot ``slot``."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in 0..{self.num_slots - 1}, got {slot}")
        return self.rows[slot * self.rows_per_slot : (slot + 1) * self.rows_per_slot]

    def close(self) -> None:
        """Unpin and drop the buffer; idempotent. Views taken earlier keep the memory alive, unpinned."""
        self._unpin()
        self._rows = None

    def __enter__(self) -> HostSlab:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # Freeing registered memory without unregistering leaves a stale CUDA
        # registration behind, so a forgotten close() is done here.
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown may have torn down CUDA already
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("pinned" if self.pinned else "pageable")
        return (
            f"HostSlab(num_slots={self.num_slots}, rows_per_slot={self.rows_per_slot}, "
            f"row_bytes={self.row_bytes}, {state})"
        )
