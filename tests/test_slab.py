from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pytest
import torch

import kvtriton.worker.slab as slab_module
from kvtriton.worker.slab import HostSlab, PageableSlabWarning


@dataclass
class FakeRegistrar:
    """Stands in for torch.cuda.cudart(): records calls, fails the call numbered ``fail_at``."""

    fail_at: int | None = None
    registered: list[tuple[int, int]] = field(default_factory=lambda: [])
    unregistered: list[int] = field(default_factory=lambda: [])
    pending_error: int = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            self.pending_error = 2
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((ptr, size))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0

    def cudaGetLastError(self) -> int:
        error, self.pending_error = self.pending_error, 0
        return error


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeRegistrar:
    registrar = FakeRegistrar()
    monkeypatch.setattr(slab_module, "_cuda_available", lambda: True)
    monkeypatch.setattr(slab_module, "_registrar", lambda: registrar)
    monkeypatch.setattr(slab_module, "memlock_limit_bytes", lambda: None)
    monkeypatch.setattr(slab_module, "PIN_CHUNK_BYTES", 2 * slab_module.HOST_PAGE_BYTES)
    return registrar


def test_slab_is_one_zeroed_uint8_buffer_with_slot_views() -> None:
    with HostSlab(num_slots=4, rows_per_slot=3, row_bytes=656, pin=False) as slab:
        assert slab.rows.shape == (12, 656)
        assert slab.rows.dtype == torch.uint8
        assert slab.rows.is_contiguous()
        assert int(slab.rows.sum()) == 0
        assert slab.nbytes == 12 * 656
        assert slab.slot(2).data_ptr() == slab.rows[6].data_ptr()
        assert slab.slot(2).shape == (3, 656)
        assert not slab.pinned


def test_slab_rows_start_on_a_host_page_boundary() -> None:
    for row_bytes in (656, 4096, 100_003):
        with HostSlab(3, 2, row_bytes, pin=False) as slab:
            assert slab.rows.data_ptr() % slab_module.HOST_PAGE_BYTES == 0


def test_slab_storage_starts_where_the_rows_start() -> None:
    # Tensor.is_pinned() asks CUDA about the storage's first byte: it must be
    # the first registered byte, or a pinned slab reads as pageable and the
    # kernels refuse it.
    with HostSlab(3, 2, 656, pin=False) as slab:
        assert slab.rows.untyped_storage().data_ptr() == slab.rows.data_ptr()
        assert slab.rows.untyped_storage().nbytes() == slab.nbytes


def test_slab_memory_outlives_close_for_views_taken_earlier() -> None:
    slab = HostSlab(2, 1, 64, pin=False)
    view = slab.slot(1)
    view.fill_(7)
    slab.close()
    del slab
    assert int(view.sum()) == 7 * 64


def test_without_cuda_the_default_slab_is_pageable_with_one_clear_warning() -> None:
    with pytest.warns(PageableSlabWarning, match="CUDA is not available.*pageable"):
        slab = HostSlab(2, 1, 64)
    assert not slab.pinned


def test_pin_false_stays_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HostSlab(2, 1, 64, pin=False).close()


def test_pin_true_without_cuda_is_an_error() -> None:
    with pytest.raises(ValueError, match="pin=True needs CUDA"):
        HostSlab(2, 1, 64, pin=True)


def test_a_slab_larger_than_available_ram_is_refused_with_both_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slab_module, "mem_available_bytes", lambda: 1000)
    with pytest.raises(ValueError, match="needs 1024 bytes, but only 1000 bytes of RAM are available"):
        HostSlab(4, 2, 128, pin=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1, 64), "num_slots must be >= 1, got 0"),
        ((1, 0, 64), "rows_per_slot must be >= 1, got 0"),
        ((1, 1, -5), "row_bytes must be >= 1, got -5"),
    ],
)
def test_bad_sizes_are_refused(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HostSlab(*args, pin=False)


def test_non_integer_sizes_are_refused() -> None:
    with pytest.raises(TypeError, match="row_bytes must be an int, got float"):
        HostSlab(1, 1, 64.0, pin=False)  # pyright: ignore[reportArgumentType] -- the wrong type is the point


def test_with_cuda_the_slab_is_pinned_in_chunks_and_close_unpins_once(fake_cuda: FakeRegistrar) -> None:
    chunk = 2 * slab_module.HOST_PAGE_BYTES
    slab = HostSlab(5, 1, chunk // 2)  # 2.5 chunks -> two whole chunks and a half one
    base = slab.rows.data_ptr()
    assert slab.pinned
    assert fake_cuda.registered == [(base, chunk), (base + chunk, chunk), (base + 2 * chunk, chunk // 2)]
    assert all(pointer % slab_module.HOST_PAGE_BYTES == 0 for pointer, _ in fake_cuda.registered)
    slab.close()
    slab.close()
    assert fake_cuda.unregistered == [base, base + chunk, base + 2 * chunk]
    assert slab.closed
    with pytest.raises(RuntimeError, match="closed"):
        _ = slab.rows


def test_a_failed_pin_unregisters_what_was_pinned_and_falls_back_with_a_warning(fake_cuda: FakeRegistrar) -> None:
    fake_cuda.fail_at = 1
    with pytest.warns(PageableSlabWarning, match="cudaHostRegister failed.*stays pageable"):
        slab = HostSlab(5, 1, slab_module.HOST_PAGE_BYTES)
    assert not slab.pinned
    assert fake_cuda.unregistered == [fake_cuda.registered[0][0]]
    assert fake_cuda.pending_error == 0  # consumed, so torch's next launch check does not report it


def test_a_failed_pin_raises_when_pinning_was_required(fake_cuda: FakeRegistrar) -> None:
    fake_cuda.fail_at = 0
    with pytest.raises(RuntimeError, match="cudaHostRegister failed with CUDA error 2"):
        HostSlab(5, 1, slab_module.HOST_PAGE_BYTES, pin=True)


def test_a_memlock_limit_below_the_slab_size_warns_before_pinning(
    fake_cuda: FakeRegistrar, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slab_module, "memlock_limit_bytes", lambda: 64 * 1024)
    with pytest.warns(PageableSlabWarning, match="RLIMIT_MEMLOCK is 65536 bytes, below the 131072-byte slab"):
        HostSlab(128, 1, 1024).close()
    assert fake_cuda.registered


def test_slots_for_budget_splits_the_total_across_ranks() -> None:
    assert HostSlab.slots_for_budget(10_000, rows_per_slot=2, row_bytes=100) == 50
    assert HostSlab.slots_for_budget(10_000, rows_per_slot=2, row_bytes=100, world_size=4) == 12
    with pytest.raises(ValueError, match="leaves 100 bytes per rank, less than one slot of 200 bytes"):
        HostSlab.slots_for_budget(400, rows_per_slot=2, row_bytes=100, world_size=4)


def test_from_budget_allocates_the_slots_that_fit() -> None:
    with HostSlab.from_budget(1000, rows_per_slot=3, row_bytes=64, pin=False) as slab:
        assert slab.num_slots == 5
        assert slab.rows.shape == (15, 64)
