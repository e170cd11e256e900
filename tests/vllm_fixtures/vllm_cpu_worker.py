"""vLLM's own CPU offloading worker, run on CPU tensors: the reference kvtriton's worker is held to.

vLLM's ``CPUOffloadingWorker`` is written for CUDA: it checks that the KV
tensors are CUDA tensors, allocates pinned host memory, records CUDA events on
its own streams and copies with a CUDA op. Everything that decides *what* it
copies (which tensors a group references, how many bytes of each page, the
slot and block arithmetic) is plain host code. Inside :func:`vllm_cpu_worker`
the CUDA pieces are replaced by host equivalents (the copy op by ``memmove``
over the same pointer lists), so the worker runs its own planning unchanged
and its ``transfer_size`` and the bytes it writes can be compared with
kvtriton's.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Generator
from types import SimpleNamespace
from unittest import mock

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor
from vllm.v1.kv_offload.cpu import gpu_worker


class _ClaimsCuda(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` with True, to pass the worker's device assertion."""

    @property
    def is_cuda(self) -> bool:  # pyright: ignore[reportIncompatibleVariableOverride] -- the point of the class
        return True


def _memmove_batch(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, **_: object) -> None:
    """``ops.swap_blocks_batch`` on the host: copy ``sizes[i]`` bytes from address ``src[i]`` to ``dst[i]``."""
    for source, destination, size in zip(src.numpy().tolist(), dst.numpy().tolist(), sizes.numpy().tolist()):
        ctypes.memmove(destination, source, size)


class _HostStream:
    def wait_stream(self, stream: object) -> None:
        del stream

    def wait_event(self, event: object) -> None:
        del event


class _HostEvent:
    """A CUDA event stand-in: the copy already ran when it is recorded."""

    def __init__(self, enable_timing: bool = False) -> None:
        del enable_timing

    def record(self, stream: object = None) -> None:
        del stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, other: object) -> float:
        del other
        return 0.0


class _HostPlatform:
    @staticmethod
    def Stream() -> _HostStream:  # noqa: N802 -- vLLM's platform attribute name
        return _HostStream()

    @staticmethod
    def current_stream() -> _HostStream:
        return _HostStream()

    @staticmethod
    def stream(stream: object) -> contextlib.nullcontext[None]:
        del stream
        return contextlib.nullcontext()

    @staticmethod
    def is_xpu() -> bool:
        return False

    @staticmethod
    def is_rocm() -> bool:
        return False


@contextlib.contextmanager
def vllm_cpu_worker(
    kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int
) -> Generator[gpu_worker.CPUOffloadingWorker]:
    """vLLM's ``CPUOffloadingWorker`` over ``kv_caches`` (CPU tensors), usable inside the ``with`` block."""
    claimed = CanonicalKVCaches(
        tensors=[
            CanonicalKVCacheTensor(
                tensor=canonical.tensor.as_subclass(_ClaimsCuda), page_size_bytes=canonical.page_size_bytes
            )
            for canonical in kv_caches.tensors
        ],
        group_data_refs=kv_caches.group_data_refs,
    )
    with (
        mock.patch.object(gpu_worker, "current_platform", _HostPlatform()),
        mock.patch.object(gpu_worker, "PIN_MEMORY", False),
        mock.patch.object(gpu_worker, "ops", SimpleNamespace(swap_blocks_batch=_memmove_batch)),
        mock.patch.object(torch, "Event", _HostEvent),
    ):
        worker = gpu_worker.CPUOffloadingWorker(claimed, blocks_per_chunk=blocks_per_chunk, num_cpu_chunks=num_chunks)
        try:
            yield worker
        finally:
            worker.shutdown()
