"""The few CUDA runtime calls torch does not bind, taken from the libcudart this process already loaded.

``cudaGetLastError`` (a failed runtime call sets the per-thread last error,
which torch would otherwise report at its next launch, far from the cause)
and ``cudaMemcpy2DAsync`` (one call copies a run of blocks between two
strided layouts: the DMA backend's unit of work). Loaded lazily: importing
this module needs no CUDA.
"""

from __future__ import annotations

import ctypes
import functools
from typing import cast

__all__ = ["CudaRuntimeError", "last_error", "loaded_cudart", "memcpy_2d_async"]

CUDA_MEMCPY_DEFAULT = 4
"""``cudaMemcpyDefault``: the direction is inferred from the pointers (unified addressing)."""


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
        return library
    return None


def last_error() -> int:
    """Read (and so clear) the runtime's last error; 0 when libcudart is not loaded."""
    library = loaded_cudart()
    return 0 if library is None else cast(int, library.cudaGetLastError())


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
            f"cudaMemcpy2DAsync({width} x {height} bytes, pitches {destination_pitch}/{source_pitch}) failed with CUDA error {code}"
        )
