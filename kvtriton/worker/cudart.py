"""The few CUDA runtime calls torch does not bind, taken from the libcudart this process already loaded.

* ``cudaGetLastError`` (a failed runtime call sets the per-thread last error,
  which torch would otherwise report at its next launch, far from the cause)
  and ``cudaGetErrorName`` (so that messages name the error, not a number);
* ``cudaMemcpy2DAsync`` (one call copies a run of blocks between two strided
  layouts: the DMA backend's unit of work);
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
from typing import cast

__all__ = [
    "CudaRuntimeError",
    "create_stream",
    "destroy_stream",
    "error_name",
    "host_device_pointer",
    "last_error",
    "loaded_cudart",
    "memcpy_2d_async",
    "stream_priority_range",
]

CUDA_MEMCPY_DEFAULT = 4
"""``cudaMemcpyDefault``: the direction is inferred from the pointers (unified addressing)."""

CUDA_STREAM_NON_BLOCKING = 1
"""``cudaStreamNonBlocking``: the stream does not synchronise with the legacy default stream (as torch's streams)."""

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
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
            ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
        ]  # fmt: skip
        library.cudaMemcpy2DAsync.restype = ctypes.c_int
        library.cudaGetLastError.restype = ctypes.c_int
        library.cudaGetErrorName.argtypes = [ctypes.c_int]
        library.cudaGetErrorName.restype = ctypes.c_char_p
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
    _check(f"cudaHostGetDevicePointer({host:#x})", cast(int, library.cudaHostGetDevicePointer(ctypes.byref(device), host, 0)))
    return int(device.value or 0)


def stream_priority_range() -> tuple[int, int]:
    """``(least, greatest)`` stream priorities of the current device (greatest is the most urgent, a lower number)."""
    library = _require_library("cudaDeviceGetStreamPriorityRange")
    least, greatest = ctypes.c_int(), ctypes.c_int()
    _check("cudaDeviceGetStreamPriorityRange", cast(int, library.cudaDeviceGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest))))
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
