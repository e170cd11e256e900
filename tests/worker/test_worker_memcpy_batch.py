"""cudaMemcpyBatchAsync's argument packing, checked on CPU with a stand-in libcudart that copies with memmove.

The stand-in decodes exactly what the C function would read (the pointer and
size arrays, the attribute struct, the counts, the stream), so the addresses
the DMA backend computes and the argument list of each runtime version are
checked without a GPU; tests/worker/test_engine_cuda.py runs the real call.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import kvtriton.worker._backends as backends_module
from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.worker._cudart import (
    CUDA_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
    CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM,
    CudaRuntimeError,
    MemcpyAttributes,
    MemcpyBatch,
    batch_from,
)
from kvtriton.worker._layout import PagedKV
from kvtriton.worker._plan import TransferDirection, plan_transfer

STREAM = 0x5EA


def _array(address: int, count: int) -> list[int]:
    return list((ctypes.c_uint64 * count).from_address(address))


def _write_version(pointer: ctypes.c_void_p, version: int) -> None:
    """Write through the ``int*`` the caller passed, as the C function does."""
    ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int)).contents.value = version


@dataclass
class FakeCudart:
    """``cudaRuntimeGetVersion`` and ``cudaMemcpyBatchAsync`` of a runtime of ``version``, copying with memmove."""

    version: int
    error: int = 0
    calls: list[tuple[int, ...]] = field(default_factory=lambda: [])
    attributes: list[MemcpyAttributes] = field(default_factory=lambda: [])

    def cudaRuntimeGetVersion(self, version: ctypes.c_void_p) -> int:  # noqa: N802 -- the C name
        _write_version(version, self.version)
        return 0

    def cudaMemcpyBatchAsync(self, *arguments: int) -> int:  # noqa: N802 -- the C name
        self.calls.append(arguments)
        destinations, sources, sizes, count, attributes, attribute_indices, num_attributes = arguments[:7]
        assert num_attributes == 1 and _array(attribute_indices, 1) == [0]
        self.attributes.append(MemcpyAttributes.from_address(attributes))
        if self.error:
            if len(arguments) == 9:
                ctypes.c_size_t.from_address(arguments[7]).value = 1
            return self.error
        for destination, source, size in zip(_array(destinations, count), _array(sources, count), _array(sizes, count)):
            ctypes.memmove(destination, source, size)
        return 0


def test_a_12_8_runtime_gets_the_fail_index_argument_and_13_does_not() -> None:
    for version, arguments in ((12080, 9), (12090, 9), (13000, 8), (13010, 8)):
        fake = FakeCudart(version)
        batch = batch_from(fake)
        assert batch is not None and batch.with_fail_index == (arguments == 9)
        source = (ctypes.c_uint8 * 8)(*range(8))
        target = (ctypes.c_uint8 * 8)()
        addresses = np.array([ctypes.addressof(target), ctypes.addressof(target) + 5], dtype=np.int64)
        batch(addresses, np.array([ctypes.addressof(source) + 2, ctypes.addressof(source)], dtype=np.int64),
              np.array([3, 2], dtype=np.int64), STREAM)  # fmt: skip
        (call,) = fake.calls
        assert len(call) == arguments and call[3] == 2 and call[-1] == STREAM
        assert list(target) == [2, 3, 4, 0, 0, 0, 1, 0]
        (attributes,) = fake.attributes
        assert attributes.src_access_order == CUDA_MEMCPY_SRC_ACCESS_ORDER_STREAM  # after the work queued before it
        assert attributes.flags == CUDA_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        assert (attributes.src_loc_hint.type, attributes.dst_loc_hint.type) == (0, 0)


def test_a_runtime_without_the_symbol_or_older_than_12_8_has_no_batch() -> None:
    class Old:
        def cudaRuntimeGetVersion(self, version: ctypes.c_void_p) -> int:  # noqa: N802 -- the C name
            _write_version(version, 12040)
            return 0

    assert batch_from(Old()) is None  # no cudaMemcpyBatchAsync: the per-run path
    assert batch_from(FakeCudart(12060)) is None  # a symbol the reported version should not have is not trusted


def test_a_failed_batch_names_the_copy_and_the_error_and_an_empty_one_calls_nothing() -> None:
    fake = FakeCudart(12080, error=1)
    batch = MemcpyBatch(fake.cudaMemcpyBatchAsync, with_fail_index=True)
    ones = np.ones(2, dtype=np.int64)
    with pytest.raises(
        CudaRuntimeError, match=r"cudaMemcpyBatchAsync\(2 copies\) failed at copy 1 with cudaErrorInvalidValue"
    ):
        batch(ones, ones, ones, STREAM)
    empty = np.empty(0, dtype=np.int64)
    batch(empty, empty, empty, STREAM)
    assert len(fake.calls) == 1
    with pytest.raises(ValueError, match="as many sources and sizes as destinations, got 2 destinations, 1 sources"):
        batch(ones, ones[:1], ones, STREAM)


def test_a_batch_on_the_legacy_default_stream_is_refused_before_the_runtime_is_called() -> None:
    # CUDA refuses cudaMemcpyBatchAsync there (the stand-in answers as it does); torch's default stream is that one.
    fake = FakeCudart(13000, error=1)
    ones = np.ones(2, dtype=np.int64)
    with pytest.raises(ValueError, match=r"refuses the legacy default stream \(handle 0"):
        MemcpyBatch(fake.cudaMemcpyBatchAsync, with_fail_index=False)(ones, ones, ones, 0)
    assert fake.calls == []


@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
def test_the_dma_backends_batched_copies_move_every_page_of_every_pair(store: bool) -> None:
    generator = torch.Generator().manual_seed(5)
    # Two page tensors of different sizes, the second with a block stride larger than its page.
    wide = torch.randint(0, 255, (10, 64), dtype=torch.uint8, generator=generator)
    narrow = torch.randint(0, 255, (10, 48), dtype=torch.uint8, generator=generator)[:, :24]
    kv = PagedKV.from_tensors([wide, narrow], layout="pages")
    slab = torch.randint(0, 255, (8, kv.row_bytes + 16), dtype=torch.uint8, generator=generator)[:, : kv.row_bytes]
    blocks, slots = [7, 2, 3, 9], [5, 0, 1, 6]
    direction = TransferDirection.STORE if store else TransferDirection.LOAD
    plan = plan_transfer(direction, GPULoadStoreSpec(blocks), CPULoadStoreSpec(slots), 1)
    pitched = backends_module._PitchedPages.of(kv, slab)  # pyright: ignore[reportPrivateUsage] -- the addresses under test
    copies = pitched.pair_copies(plan.gpu_blocks, plan.slab_rows, store)
    assert [column.shape[0] for column in copies] == [2 * 4] * 3  # one copy per (page tensor, pair)
    slab_before, pages_before = slab.clone(), [page.clone() for page in kv.byte_pages()]
    MemcpyBatch(FakeCudart(13000).cudaMemcpyBatchAsync, with_fail_index=False)(*copies, STREAM)
    for block, slot in zip(blocks, slots):
        row = b"".join(
            (pages_before if store else [page for page in kv.byte_pages()])[t][block].numpy().tobytes()
            for t in range(2)
        )
        target = slab[slot] if store else slab_before[slot]
        assert target.numpy().tobytes() == row
    untouched_rows = [row for row in range(8) if row not in slots]
    if store:
        assert torch.equal(slab[untouched_rows], slab_before[untouched_rows])
    else:
        untouched_blocks = [block for block in range(10) if block not in blocks]
        for page, before in zip(kv.byte_pages(), pages_before):
            assert torch.equal(page[untouched_blocks], before[untouched_blocks])
