from __future__ import annotations

import mmap
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import kvtriton.worker._numa as numa_module
import kvtriton.worker._slab as slab_module
from kvtriton.worker._slab import HostMemoryPath, HostSlab, PageableSlabWarning, SlabPinningError


@dataclass
class FakeRegistrar:
    """Stands in for torch.cuda.cudart(): records calls, fails the call numbered ``fail_at``."""

    fail_at: int | None = None
    registered: list[tuple[int, int]] = field(default_factory=lambda: [])
    unregistered: list[int] = field(default_factory=lambda: [])
    pending_error: int = 0
    cpus_while_registering: list[set[int]] = field(default_factory=lambda: [])

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 -- the CUDA name
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            self.pending_error = 2
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((ptr, size))
        self.cpus_while_registering.append(os.sched_getaffinity(0))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 -- the CUDA name
        self.unregistered.append(ptr)
        return 0

    def cudaGetLastError(self) -> int:  # noqa: N802 -- the CUDA name
        error, self.pending_error = self.pending_error, 0
        return error


ORIGINAL_DEVICE_POINTER = slab_module._device_pointer  # pyright: ignore[reportPrivateUsage] -- restored in one test


def only_the_given_gpu(gpu: int | None) -> int | None:
    """Placement without the current CUDA device: on a GPU machine these tests still place nothing by default."""
    return gpu


def same_address(host: int) -> int:
    return host


def gpu_bus_id(index: int) -> str:
    del index
    return "0000:3B:00.0"  # upper case, as some tools print it; sysfs names are lower case


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeRegistrar:
    registrar = FakeRegistrar()
    monkeypatch.setattr(slab_module, "_cuda_available", lambda: True)
    monkeypatch.setattr(slab_module, "_registrar", lambda: registrar)
    monkeypatch.setattr(slab_module, "memlock_limit_bytes", lambda: None)
    monkeypatch.setattr(slab_module, "PIN_CHUNK_BYTES", 2 * slab_module.HOST_PAGE_BYTES)
    monkeypatch.setattr(slab_module, "_device_pointer", same_address)  # x86 with a recent driver: alias == host
    monkeypatch.setattr(slab_module, "placement_gpu", only_the_given_gpu)
    return registrar


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about a machine without CUDA: on a GPU machine they still see none."""
    monkeypatch.setattr(slab_module, "_cuda_available", lambda: False)


def test_slab_is_one_zeroed_uint8_buffer_with_slot_views() -> None:
    with HostSlab(num_slots=4, block_size_factor=3, row_bytes=656, pin=False) as slab:
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


@pytest.mark.usefixtures("no_cuda")
def test_without_cuda_the_default_slab_is_pageable_with_one_clear_warning() -> None:
    with pytest.warns(PageableSlabWarning, match="CUDA is not available.*pageable"):
        slab = HostSlab(2, 1, 64)
    assert not slab.pinned


def test_pin_false_stays_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HostSlab(2, 1, 64, pin=False).close()


@pytest.mark.usefixtures("no_cuda")
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
        ((1, 0, 64), "block_size_factor must be >= 1, got 0"),
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


def test_a_failed_pin_unregisters_what_was_pinned_and_raises_one_line_naming_the_error_and_the_ram(
    fake_cuda: FakeRegistrar, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slab_module, "memlock_limit_bytes", lambda: 64 * 1024)
    monkeypatch.setattr(slab_module, "mem_available_bytes", lambda: 2**40)
    fake_cuda.fail_at = 1
    nbytes = 5 * slab_module.HOST_PAGE_BYTES
    with pytest.raises(SlabPinningError) as raised:
        HostSlab(5, 1, slab_module.HOST_PAGE_BYTES)
    message = str(raised.value)
    assert "\n" not in message
    assert f"cannot pin the {nbytes}-byte host slab" in message
    assert "cudaHostRegister failed with cudaErrorMemoryAllocation (2)" in message  # the CUDA error, by name
    assert "MemAvailable is 1099511627776 bytes" in message
    # The limit is named for information only: cudaHostRegister is not charged to it, so no advice to raise it.
    assert "RLIMIT_MEMLOCK is 65536 bytes (for information: the NVIDIA driver does not charge" in message
    assert "ulimit" not in message and "allow_pageable=True" in message
    assert fake_cuda.unregistered == [fake_cuda.registered[0][0]]
    assert fake_cuda.pending_error == 0  # consumed, so torch's next launch check does not report it


def test_allow_pageable_keeps_a_slab_that_failed_to_pin_with_a_warning(fake_cuda: FakeRegistrar) -> None:
    fake_cuda.fail_at = 0
    with pytest.warns(PageableSlabWarning, match="cannot pin.*RLIMIT_MEMLOCK.*stays pageable"):
        slab = HostSlab(5, 1, slab_module.HOST_PAGE_BYTES, allow_pageable=True)
    assert not slab.pinned
    assert fake_cuda.pending_error == 0


def test_a_failed_pin_raises_when_pinning_was_required(fake_cuda: FakeRegistrar) -> None:
    fake_cuda.fail_at = 0
    with pytest.raises(SlabPinningError, match=r"cudaHostRegister failed with cudaErrorMemoryAllocation \(2\)"):
        HostSlab(5, 1, slab_module.HOST_PAGE_BYTES, pin=True, allow_pageable=False)


@pytest.mark.parametrize(
    ("nbytes", "slot_bytes", "chunk_bytes", "page_bytes"),
    [
        (10 * 4096, 4096, 3 * 4096, 4096),  # page-sized slots: chunks of 3 slots
        (7 * 6144, 6144, 4 * 4096, 4096),  # 1.5-page slots: boundaries every 2 slots (3 pages)
        (9 * 1000, 1000, 5000, 4096),  # odd slots: only every 512th slot boundary is page-aligned
        (5 * 3 * 656, 3 * 656, 1 << 30, 4096),  # one chunk larger than the slab
    ],
)
def test_pin_ranges_end_on_slot_and_page_boundaries_and_cover_the_slab(
    nbytes: int, slot_bytes: int, chunk_bytes: int, page_bytes: int
) -> None:
    ranges = slab_module.pin_ranges(nbytes, slot_bytes, chunk_bytes, page_bytes)
    assert ranges[0][0] == 0
    assert sum(size for _, size in ranges) == nbytes
    for (offset, size), (following, _) in zip(ranges, ranges[1:]):
        assert offset + size == following
        assert following % slot_bytes == 0 and following % page_bytes == 0


def test_a_slab_with_odd_rows_pins_chunks_that_never_split_a_slot(fake_cuda: FakeRegistrar) -> None:
    slot_bytes = 3 * 1000
    with HostSlab(2048, 3, 1000) as slab:
        base = slab.rows.data_ptr()
        assert len(fake_cuda.registered) > 1
        for pointer, _ in fake_cuda.registered[1:]:
            assert (pointer - base) % slot_bytes == 0 and pointer % slab_module.HOST_PAGE_BYTES == 0
        assert sum(size for _, size in fake_cuda.registered) == slab.nbytes


def _shared_file(tmp_path: Path, nbytes: int) -> mmap.mmap:
    path = tmp_path / "slab.shm"
    with open(path, "wb") as file:
        file.truncate(nbytes)
    with open(path, "r+b") as file:
        return mmap.mmap(file.fileno(), nbytes)


def test_a_slab_adopts_a_shared_mapping_and_writes_land_in_it(tmp_path: Path) -> None:
    mapping = _shared_file(tmp_path, 4 * 2 * 64)
    slab = HostSlab.from_buffer(mapping, num_slots=4, block_size_factor=2, row_bytes=64, pin=False)
    assert not slab.owns_memory
    slab.slot(3).fill_(9)
    assert mapping[6 * 64 : 8 * 64] == bytes([9]) * 128
    assert mapping[: 6 * 64] == bytes(6 * 64)
    slab.close()
    assert not mapping.closed  # the slab never unmaps memory it does not own
    mapping[0] = 1
    mapping.close()


def test_per_rank_strided_views_of_one_buffer_write_disjoint_bytes(tmp_path: Path) -> None:
    ranks, row_bytes, num_slots = 3, 40, 5
    stride = ranks * row_bytes
    mapping = _shared_file(tmp_path, num_slots * stride)
    views = [
        HostSlab.from_buffer(
            mapping, num_slots, 1, row_bytes, row_stride=stride, row_offset=rank * row_bytes, pin=False
        )
        for rank in range(ranks)
    ]
    for rank, view in enumerate(views):
        assert view.rows.shape == (num_slots, row_bytes) and view.rows.stride() == (stride, 1)
        view.rows.fill_(rank + 1)
    raw = torch.frombuffer(mapping, dtype=torch.uint8).view(num_slots, ranks, row_bytes)
    for rank in range(ranks):
        assert bool((raw[:, rank] == rank + 1).all())
    for view in views:
        view.close()
    del raw
    mapping.close()


def test_a_pinned_per_rank_view_registers_whole_shared_rows_in_slot_chunks(fake_cuda: FakeRegistrar) -> None:
    page = slab_module.HOST_PAGE_BYTES
    buffer = mmap.mmap(-1, 8 * page)
    with HostSlab.from_buffer(buffer, 8, 1, page // 2, row_stride=page, row_offset=page // 2) as slab:
        assert slab.pinned
        base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
        assert fake_cuda.registered == [
            (base, 2 * page),
            (base + 2 * page, 2 * page),
            (base + 4 * page, 2 * page),
            (base + 6 * page, 2 * page),
        ]
        assert slab.rows.data_ptr() == base + page // 2


@pytest.mark.parametrize(
    ("row_stride", "row_offset", "message"),
    [
        (64, 32, "row_offset 32 \\+ row_bytes 64 = 96 does not fit in row_stride 64"),
        (None, -1, "row_offset must be >= 0, got -1"),
        (0, 0, "row_stride must be >= 1, got 0"),
    ],
)
def test_bad_buffer_layouts_are_refused(row_stride: int | None, row_offset: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HostSlab.from_buffer(bytearray(1024), 2, 1, 64, row_stride=row_stride, row_offset=row_offset, pin=False)


def test_a_buffer_too_small_for_the_slots_is_refused_with_both_sizes() -> None:
    with pytest.raises(ValueError, match="buffer holds 100 bytes but 2 slots x 1 rows of stride 64 .* need 128"):
        HostSlab.from_buffer(bytearray(100), 2, 1, 64, pin=False)
    with pytest.raises(ValueError, match="buffer must be a contiguous 1-D uint8 CPU tensor"):
        HostSlab.from_buffer(torch.zeros(64, dtype=torch.int32), 1, 1, 64, pin=False)


def test_an_unaligned_buffer_cannot_be_pinned(fake_cuda: FakeRegistrar) -> None:
    flat = torch.frombuffer(mmap.mmap(-1, 2 * slab_module.HOST_PAGE_BYTES), dtype=torch.uint8)[8:]
    with pytest.raises(ValueError, match="not on a .*host page boundary"):
        HostSlab.from_buffer(flat, 1, 1, 64)
    assert not fake_cuda.registered


@dataclass
class RecordingUser:
    """A slab user that records, when drained, whether the slab was still pinned."""

    slab: HostSlab
    pinned_when_drained: list[bool] = field(default_factory=lambda: [])

    def drain(self) -> None:
        self.pinned_when_drained.append(self.slab.pinned)


def test_close_drains_every_live_user_before_unpinning(fake_cuda: FakeRegistrar) -> None:
    slab = HostSlab(4, 1, slab_module.HOST_PAGE_BYTES)
    users = [RecordingUser(slab), RecordingUser(slab)]
    for user in users:
        slab.add_user(user)
    slab.close()
    slab.close()
    assert [user.pinned_when_drained for user in users] == [[True], [True]]  # drained once each, before unpinning
    assert not slab.pinned and fake_cuda.unregistered


def test_slots_for_budget_splits_the_total_across_ranks() -> None:
    assert HostSlab.slots_for_budget(10_000, block_size_factor=2, row_bytes=100) == 50
    assert HostSlab.slots_for_budget(10_000, block_size_factor=2, row_bytes=100, world_size=4) == 12
    with pytest.raises(ValueError, match="leaves 100 bytes per rank, less than one slot of 200 bytes"):
        HostSlab.slots_for_budget(400, block_size_factor=2, row_bytes=100, world_size=4)


def test_from_budget_allocates_the_slots_that_fit() -> None:
    with HostSlab.from_budget(1000, block_size_factor=3, row_bytes=64, pin=False) as slab:
        assert slab.num_slots == 5
        assert slab.rows.shape == (15, 64)


def test_a_low_memlock_limit_never_stops_a_pin(fake_cuda: FakeRegistrar, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slab_module, "memlock_limit_bytes", lambda: 4096)
    with HostSlab(5, 1, slab_module.HOST_PAGE_BYTES) as slab:  # 20 KiB over a 4 KiB limit: pinned all the same
        assert slab.pinned and len(fake_cuda.registered) >= 1


def test_with_an_unlimited_memlock_a_failed_pin_names_it_for_information(fake_cuda: FakeRegistrar) -> None:
    fake_cuda.fail_at = 0
    with pytest.raises(SlabPinningError, match=r"RLIMIT_MEMLOCK is unlimited \(for information"):
        HostSlab(5, 1, slab_module.HOST_PAGE_BYTES)


def test_a_pinned_slab_reports_its_rows_per_registration_where_runs_must_be_cut(fake_cuda: FakeRegistrar) -> None:
    page = slab_module.HOST_PAGE_BYTES
    with HostSlab(10, 2, page // 2) as slab:  # slots of one page, registrations of two
        assert len(fake_cuda.registered) == 5
        assert slab.registration_rows == 4
        assert slab.device_aliased
    assert slab.registration_rows is None
    with HostSlab(10, 2, page // 2, pin=False) as pageable:
        assert pageable.registration_rows is None


def test_a_registration_reached_at_another_device_address_marks_the_slab_not_aliased(
    fake_cuda: FakeRegistrar, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    second: list[int] = []

    def device_pointer(host: int) -> int:
        second.append(host)
        return host if len(second) == 1 else host + (1 << 40)  # the first chunk aliases, the second does not

    monkeypatch.setattr(slab_module, "_device_pointer", device_pointer)
    with HostSlab(4, 1, slab_module.HOST_PAGE_BYTES) as slab:
        assert slab.pinned and not slab.device_aliased
    assert len(second) == 2  # every registration was checked
    assert "triton backend" in caplog.text


def test_an_allocated_slab_is_not_inherited_by_forked_children() -> None:
    # MADV_DONTFORK shows as the "dc" (do not copy) VmFlag of the mapping in /proc/self/smaps.
    with HostSlab(4, 1, slab_module.HOST_PAGE_BYTES, pin=False) as slab:
        start = f"{slab.rows.data_ptr():x}-"
        with open("/proc/self/smaps", encoding="ascii") as smaps:
            text = smaps.read()
        section = text[text.index(start) :]
        flags = next(line for line in section.splitlines() if line.startswith("VmFlags:"))
        assert "dc" in flags.split(":", 1)[1].split(), flags


def _fake_two_node_host(root: Path, gpu_node: int, node_cpus: dict[int, str]) -> None:
    for node, cpus in node_cpus.items():
        folder = root / "devices" / "system" / "node" / f"node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(cpus + "\n")
    device = root / "bus" / "pci" / "devices" / "0000:3b:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text(f"{gpu_node}\n")


def test_pinning_runs_on_the_cpus_of_the_gpus_numa_node_and_moves_back(
    fake_cuda: FakeRegistrar, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    gpu_cpu = allowed[-1]
    _fake_two_node_host(tmp_path, 1, {0: "0" if gpu_cpu else "1", 1: str(gpu_cpu)})
    monkeypatch.setattr(numa_module, "SYSFS_ROOT", str(tmp_path))
    monkeypatch.setattr(numa_module, "cuda_pci_bus_id", gpu_bus_id)
    before = os.sched_getaffinity(0)
    with HostSlab(4, 1, slab_module.HOST_PAGE_BYTES, gpu=0):
        pass
    assert fake_cuda.cpus_while_registering and all(cpus == {gpu_cpu} for cpus in fake_cuda.cpus_while_registering)
    assert os.sched_getaffinity(0) == before


def test_a_host_with_one_numa_node_pins_where_it_runs(
    fake_cuda: FakeRegistrar, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_two_node_host(tmp_path, 0, {0: "0"})
    monkeypatch.setattr(numa_module, "SYSFS_ROOT", str(tmp_path))
    monkeypatch.setattr(numa_module, "cuda_pci_bus_id", gpu_bus_id)
    before = os.sched_getaffinity(0)
    with HostSlab(2, 1, slab_module.HOST_PAGE_BYTES, gpu=0):
        pass
    assert fake_cuda.cpus_while_registering == [before]


def test_a_bad_gpu_index_is_refused() -> None:
    with pytest.raises(ValueError, match="gpu must be >= 0, got -1"):
        HostSlab(2, 1, 64, pin=False, gpu=-1)


def test_a_failing_device_address_query_keeps_the_slab_pinned_but_not_for_triton(
    fake_cuda: FakeRegistrar, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtriton.worker._cudart import CudaRuntimeError

    def failing(host: int) -> int:
        raise CudaRuntimeError(f"cudaHostGetDevicePointer({host:#x}) failed with cudaErrorInvalidValue (1)")

    monkeypatch.setattr(slab_module, "host_device_pointer", failing)
    monkeypatch.setattr(
        slab_module, "_device_pointer", ORIGINAL_DEVICE_POINTER
    )  # the real query, over the failing call
    with HostSlab(2, 1, slab_module.HOST_PAGE_BYTES) as slab:
        assert slab.pinned and not slab.device_aliased
    assert fake_cuda.unregistered  # closed normally: nothing leaked


def test_a_strided_view_registers_whole_shared_rows_in_slot_aligned_pieces_not_row_by_row(
    fake_cuda: FakeRegistrar,
) -> None:
    page = slab_module.HOST_PAGE_BYTES  # PIN_CHUNK_BYTES is two pages here (the fixture)
    # Rows of four pages, this view's bytes a page and a half from 100 bytes in: a whole page of other bytes
    # lies between two rows, yet registering the view's own pages would cost one call per row.
    buffer = mmap.mmap(-1, 6 * 4 * page, flags=mmap.MAP_PRIVATE)
    with HostSlab.from_buffer(buffer, 3, 2, page + page // 2, row_stride=4 * page, row_offset=100) as slab:
        ranges, rows_per_registration = slab.registration_plan()
        # Slots of two four-page rows: each piece is one slot (the smallest slot- and page-aligned span).
        assert (ranges, rows_per_registration) == ([(0, 8 * page), (8 * page, 8 * page), (16 * page, 8 * page)], 2)
        base = slab.rows.data_ptr() - 100
        assert fake_cuda.registered == [(base + offset, size) for offset, size in ranges]
        assert slab.registration_rows == 2 and slab.memory_path is HostMemoryPath.REGISTERED
