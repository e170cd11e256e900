"""The few CUDA runtime calls torch does not bind, taken from the libcudart this process already loaded.

* ``cudaGetLastError`` (a failed runtime call sets the per-thread last error,
  which torch would otherwise report at its next launch, far from the cause)
  and ``cudaGetErrorName`` (so that messages name the error, not a number);
* ``cudaMemcpy2DAsync`` (one call copies a run of blocks between two strided
  layouts: the DMA backend's unit of work where the runtime has no batch call);
* ``cudaMemcpyBatchAsync`` (CUDA 12.8 and later: one call queues every copy of
  a job, :class:`MemcpyBatch`; resolved by name, so an older runtime reads as
  "not available" and the per-run path above is used instead) and
  ``cudaRuntimeGetVersion`` (the batch call lost its ``failIdx`` argument in
  CUDA 13, so its argument list depends on the version);
* ``cudaHostAlloc`` / ``cudaFreeHost`` (a slab whose memory the driver
  refuses to register, as in confidential-computing mode, takes pinned memory
  the driver allocates instead);
* ``cudaHostGetDevicePointer`` (the slab checks that every registration is
  reached on the device at its host address, which the Triton path relies on);
* ``cudaStreamCreateWithPriority`` / ``cudaStreamDestroy`` /
  ``cudaDeviceGetStreamPriorityRange``: the engine's lanes get streams of
  their own (``torch.cuda.Stream()`` hands out pool streams round-robin,
  shared with every other ``Stream()`` in the process, vLLM's included).

Loaded lazily: importing this module needs no CUDA.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import cast

import numpy as np
from numpy.typing import NDArray

CUDA_MEMCPY_DEFAULT = 4
"""``cudaMemcpyDefault``: the direction is inferred from the pointers (unified addressing)."""

CUDA_STREAM_NON_BLOCKING = 1
"""``cudaStreamNonBlocking``: the stream does not synchronise with the legacy default stream (as torch's streams)."""

CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
"""``cudaMemcpySrcAccessOrderStream``: a batched copy reads its source in stream order (after the work queued before it)."""

CUDA_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
"""``cudaMemcpyFlagPreferOverlapWithCompute``: the copies run on the copy engines, beside the model's kernels."""

BATCH_MIN_RUNTIME = 12080
"""The first runtime (CUDA 12.8) with ``cudaMemcpyBatchAsync``."""

BATCH_WITHOUT_FAIL_INDEX_RUNTIME = 13000
"""From CUDA 13.0 ``cudaMemcpyBatchAsync`` takes no ``failIdx`` pointer (12.8 and 12.9 do, before the stream)."""

_ERROR_NAMES = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError",
    100: "cudaErrorNoDevice",
    101: "cudaErrorInvalidDevice",
    304: "cudaErrorOperatingSystem",
    712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered",
    801: "cudaErrorNotSupported",
}
"""Names of the errors pinning and copies meet, for when libcudart is not loaded (messages still name them)."""


class CudaRuntimeError(RuntimeError):
    """A CUDA runtime call returned an error code."""


@functools.cache
def loaded_cudart() -> ctypes.CDLL | None:
    """The libcudart shared library mapped into this process (torch's own copy), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = [line.split()[-1] for line in maps if "libcudart" in line]
    except OSError:
        return None
    for path in paths:
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        library.cudaMemcpy2DAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        library.cudaMemcpy2DAsync.restype = ctypes.c_int
        library.cudaGetLastError.restype = ctypes.c_int
        library.cudaGetErrorName.argtypes = [ctypes.c_int]
        library.cudaGetErrorName.restype = ctypes.c_char_p
        library.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        library.cudaHostAlloc.restype = ctypes.c_int
        library.cudaFreeHost.argtypes = [ctypes.c_void_p]
        library.cudaFreeHost.restype = ctypes.c_int
        library.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
        library.cudaHostGetDevicePointer.restype = ctypes.c_int
        library.cudaStreamCreateWithPriority.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_int]
        library.cudaStreamCreateWithPriority.restype = ctypes.c_int
        library.cudaStreamDestroy.argtypes = [ctypes.c_void_p]
        library.cudaStreamDestroy.restype = ctypes.c_int
        library.cudaDeviceGetStreamPriorityRange.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        library.cudaDeviceGetStreamPriorityRange.restype = ctypes.c_int
        return library
    return None


def last_error() -> int:
    """Read (and so clear) the runtime's last error; 0 when libcudart is not loaded."""
    library = loaded_cudart()
    return 0 if library is None else cast(int, library.cudaGetLastError())


def error_name(code: int) -> str:
    """``cudaErrorMemoryAllocation (2)``: the runtime's name for ``code`` and the number."""
    library = loaded_cudart()
    name = _ERROR_NAMES.get(code)
    if library is not None:
        raw = cast(bytes | None, library.cudaGetErrorName(code))
        if raw:
            name = raw.decode(errors="replace")
    return f"{name or 'CUDA error'} ({code})"


def _require_library(call: str) -> ctypes.CDLL:
    library = loaded_cudart()
    if library is None:
        raise CudaRuntimeError(f"{call}: libcudart is not loaded in this process (is CUDA initialised?)")
    return library


def _check(call: str, code: int) -> None:
    if code != 0:
        last_error()  # consumed here, not reported by torch's next launch check
        raise CudaRuntimeError(f"{call} failed with {error_name(code)}")


def host_device_pointer(host: int) -> int | None:
    """The device address of registered host memory at ``host``, or None where libcudart is not loaded."""
    library = loaded_cudart()
    if library is None:
        return None
    device = ctypes.c_void_p()
    _check(
        f"cudaHostGetDevicePointer({host:#x})",
        cast(int, library.cudaHostGetDevicePointer(ctypes.byref(device), host, 0)),
    )
    return int(device.value or 0)


CUDA_HOST_ALLOC_DEFAULT = 0
"""``cudaHostAllocDefault``: page-locked, reached by every device at its host address (unified addressing), as torch's
own pinned allocations are."""


def host_alloc(nbytes: int) -> tuple[int, int]:
    """``cudaHostAlloc(nbytes)``: ``(error code, address)``, the address 0 unless the code is 0 (``cudaSuccess``).

    A failing call's last error is consumed here. ``CudaRuntimeError`` where
    libcudart is not loaded.
    """
    library = _require_library("cudaHostAlloc")
    pointer = ctypes.c_void_p()
    code = cast(int, library.cudaHostAlloc(ctypes.byref(pointer), nbytes, CUDA_HOST_ALLOC_DEFAULT))
    if code != 0:
        last_error()
        return code, 0
    return 0, int(pointer.value or 0)


def free_host(pointer: int) -> int:
    """``cudaFreeHost(pointer)`` for memory :func:`host_alloc` gave: the error code (0: freed)."""
    library = _require_library("cudaFreeHost")
    code = cast(int, library.cudaFreeHost(pointer))
    if code != 0:
        last_error()
    return code


def stream_priority_range() -> tuple[int, int]:
    """``(least, greatest)`` stream priorities of the current device (greatest is the most urgent, a lower number)."""
    library = _require_library("cudaDeviceGetStreamPriorityRange")
    least, greatest = ctypes.c_int(), ctypes.c_int()
    _check(
        "cudaDeviceGetStreamPriorityRange",
        cast(int, library.cudaDeviceGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest))),
    )
    return least.value, greatest.value


def create_stream(priority: int) -> int:
    """A new non-blocking stream on the current device, used by no one else; free it with :func:`destroy_stream`."""
    library = _require_library("cudaStreamCreateWithPriority")
    stream = ctypes.c_void_p()
    _check(
        f"cudaStreamCreateWithPriority(priority={priority})",
        cast(int, library.cudaStreamCreateWithPriority(ctypes.byref(stream), CUDA_STREAM_NON_BLOCKING, priority)),
    )
    return int(stream.value or 0)


def destroy_stream(stream: int) -> None:
    """Release a stream made by :func:`create_stream` (work queued on it still completes)."""
    library = _require_library("cudaStreamDestroy")
    _check(f"cudaStreamDestroy({stream:#x})", cast(int, library.cudaStreamDestroy(stream)))


def memcpy_2d_async(
    destination: int, destination_pitch: int, source: int, source_pitch: int, width: int, height: int, stream: int
) -> None:
    """``height`` rows of ``width`` bytes between two pitched layouts, queued on ``stream``."""
    library = loaded_cudart()
    if library is None:
        raise CudaRuntimeError("libcudart is not loaded in this process (is CUDA initialised?)")
    code = cast(
        int,
        library.cudaMemcpy2DAsync(
            destination, destination_pitch, source, source_pitch, width, height, CUDA_MEMCPY_DEFAULT, stream
        ),
    )
    if code != 0:
        last_error()
        raise CudaRuntimeError(
            f"cudaMemcpy2DAsync({width} x {height} bytes, pitches {destination_pitch}/{source_pitch}) failed with "
            f"{error_name(code)}"
        )


class MemLocation(ctypes.Structure):
    """``cudaMemLocation``: a location hint (``type`` 0, invalid, leaves the choice to the driver)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes`` (CUDA 12.8): how the copies of a batch read their sources."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_hint", MemLocation),
        ("dst_loc_hint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


LEGACY_DEFAULT_STREAM = 0
"""The raw handle of CUDA's legacy default stream (``torch.cuda.default_stream().cuda_stream``)."""


class MemcpyBatch:
    """``cudaMemcpyBatchAsync``: queue ``count`` one-dimensional copies on a stream with one runtime call.

    ``call`` is the C function (or a stand-in with its argument list);
    ``with_fail_index``: the runtime is 12.8 or 12.9, whose call takes a
    ``size_t* failIdx`` before the stream (CUDA 13 dropped it). Every copy
    reads its source in stream order (after the work queued before it, as
    ``cudaMemcpy2DAsync`` does) and prefers the copy engines, beside compute.
    """

    def __init__(self, call: Callable[..., int], *, with_fail_index: bool) -> None:
        self._call = call
        self.with_fail_index = with_fail_index
        self._attributes = MemcpyAttributes(
            CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            MemLocation(0, 0),
            MemLocation(0, 0),
            CUDA_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
        )
        self._attribute_index = (ctypes.c_size_t * 1)(0)  # copy 0 onwards use attribute 0: all of them

    def __call__(
        self, destinations: NDArray[np.int64], sources: NDArray[np.int64], sizes: NDArray[np.int64], stream: int
    ) -> None:
        """Copy ``sizes[i]`` bytes from ``sources[i]`` to ``destinations[i]`` for every ``i``, queued on ``stream``.

        ``stream`` must not be 0, the legacy default stream, which the runtime
        refuses for this call (``ValueError`` here, before any call).
        """
        count = destinations.shape[0]
        if stream == LEGACY_DEFAULT_STREAM:
            raise ValueError(
                "cudaMemcpyBatchAsync refuses the legacy default stream (handle 0, torch's default stream); "
                "queue the batch on a stream of its own (under torch.cuda.stream(torch.cuda.Stream()), as the "
                "engine's lanes are)"
            )
        if sources.shape[0] != count or sizes.shape[0] != count:
            raise ValueError(
                f"a copy batch needs as many sources and sizes as destinations, got {count} destinations, "
                f"{sources.shape[0]} sources and {sizes.shape[0]} sizes"
            )
        if count == 0:
            return
        # void* and size_t are 64-bit here: the int64 addresses and sizes are passed as the arrays C reads.
        packed = [np.ascontiguousarray(column, dtype=np.uint64) for column in (destinations, sources, sizes)]
        arguments: list[object] = [
            *(column.ctypes.data for column in packed),
            count,
            ctypes.addressof(self._attributes),
            ctypes.addressof(self._attribute_index),
            1,
        ]
        fail_index = ctypes.c_size_t(0)
        if self.with_fail_index:
            arguments.append(ctypes.addressof(fail_index))
        arguments.append(stream)
        code = self._call(*arguments)
        if code != 0:
            last_error()
            failed = f" at copy {fail_index.value}" if self.with_fail_index else ""
            raise CudaRuntimeError(f"cudaMemcpyBatchAsync({count} copies) failed{failed} with {error_name(code)}")


def batch_from(library: object) -> MemcpyBatch | None:
    """``library``'s ``cudaMemcpyBatchAsync`` with the argument list of its runtime version; None where it has none.

    ``library`` is a loaded libcudart (or a stand-in exposing the two calls).
    A runtime older than 12.8 has no such symbol; one that reports an older
    version than the symbol needs is not trusted with it either.
    """
    call = cast(Callable[..., int] | None, getattr(library, "cudaMemcpyBatchAsync", None))
    get_version = cast(Callable[..., int] | None, getattr(library, "cudaRuntimeGetVersion", None))
    if call is None or get_version is None:
        return None
    version = ctypes.c_int(0)
    if isinstance(library, ctypes.CDLL):
        library.cudaRuntimeGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        library.cudaRuntimeGetVersion.restype = ctypes.c_int
    if get_version(ctypes.pointer(version)) != 0 or version.value < BATCH_MIN_RUNTIME:
        return None
    with_fail_index = version.value < BATCH_WITHOUT_FAIL_INDEX_RUNTIME
    if isinstance(library, ctypes.CDLL):
        pointers = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        library.cudaMemcpyBatchAsync.argtypes = (
            pointers + ([ctypes.c_void_p] if with_fail_index else []) + [ctypes.c_void_p]
        )
        library.cudaMemcpyBatchAsync.restype = ctypes.c_int
    return MemcpyBatch(call, with_fail_index=with_fail_index)


@functools.cache
def memcpy_batch() -> MemcpyBatch | None:
    """The loaded libcudart's :class:`MemcpyBatch`, or None (no libcudart, or a runtime before CUDA 12.8)."""
    library = loaded_cudart()
    return None if library is None else batch_from(library)
