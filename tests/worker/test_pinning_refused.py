"""When CUDA refuses to pin: the slab takes cudaHostAlloc memory, a shared region's ranks all go pageable together.

A stand-in CUDA runtime refuses every ``cudaHostRegister`` as a GPU in
confidential-computing mode does (``cudaErrorNotSupported``, 801), or only
some ranks' (a driver's size cap, a container's limits on one rank). Several
SharedRegion objects in one process stand in for the engine's processes,
each rank on a thread of its own, as in tests/integrations/vllm/test_tiering_region.py.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import kvtriton.worker._slab as slab_module
from kvtriton.worker._shared_region import RegionLayout, SharedRegion
from kvtriton.worker._slab import HostMemoryPath, HostSlab, PageableSlabWarning, SlabPinningError

NOT_SUPPORTED = 801  # cudaErrorNotSupported: what confidential computing answers every registration with
PAGE = slab_module.HOST_PAGE_BYTES


@dataclass
class RefusingRuntime:
    """Stands in for CUDA's host registration; refuses the calls of the threads in ``refused_threads`` (all: None)."""

    code: int = NOT_SUPPORTED
    refused_threads: set[str] | None = None
    registered: list[tuple[int, int]] = field(default_factory=lambda: [])
    unregistered: list[int] = field(default_factory=lambda: [])
    refusals: int = 0
    pending_error: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 -- the CUDA name
        with self.lock:
            if self.refused_threads is None or threading.current_thread().name in self.refused_threads:
                self.refusals += 1
                self.pending_error = self.code
                return self.code
            self.registered.append((ptr, size))
            return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 -- the CUDA name
        with self.lock:
            self.unregistered.append(ptr)
        return 0

    def cudaGetLastError(self) -> int:  # noqa: N802 -- the CUDA name
        with self.lock:
            error, self.pending_error = self.pending_error, 0
        return error


@dataclass
class StandInHostAllocator:
    """Stands in for ``cudaHostAlloc``/``cudaFreeHost``: real memory from ctypes, or refusal with ``code``."""

    code: int = 0
    allocated: dict[int, ctypes.Array[ctypes.c_char]] = field(default_factory=lambda: {})
    freed: list[int] = field(default_factory=lambda: [])

    def host_alloc(self, nbytes: int) -> tuple[int, int]:
        if self.code:
            return self.code, 0
        memory = ctypes.create_string_buffer(nbytes)
        self.allocated[ctypes.addressof(memory)] = memory
        return 0, ctypes.addressof(memory)

    def free_host(self, pointer: int) -> int:
        self.freed.append(pointer)
        del self.allocated[pointer]
        return 0


def same_address(host: int) -> int:
    return host  # x86 with a recent driver: the device reaches pinned memory at its host address


def only_the_given_gpu(gpu: int | None) -> int | None:
    return gpu


def as_if_on_cuda(
    monkeypatch: pytest.MonkeyPatch, runtime: RefusingRuntime, allocator: StandInHostAllocator | None
) -> None:
    monkeypatch.setattr(slab_module, "_cuda_available", lambda: True)
    monkeypatch.setattr(slab_module, "_registrar", lambda: runtime)
    monkeypatch.setattr(slab_module, "_host_allocator", lambda: allocator)
    monkeypatch.setattr(slab_module, "_device_pointer", same_address)
    monkeypatch.setattr(slab_module, "placement_gpu", only_the_given_gpu)


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


# --- the single-process slab: cudaHostAlloc instead ----------------------------


def test_a_refused_slab_takes_cudahostalloc_memory_with_one_warning_and_reports_that_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runtime, allocator = RefusingRuntime(), StandInHostAllocator()
    as_if_on_cuda(monkeypatch, runtime, allocator)
    with caplog.at_level(logging.INFO, logger="kvtriton"):
        slab = HostSlab(4, 2, 1000)
    try:
        assert runtime.refusals == 1 and runtime.registered == [] and runtime.pending_error == 0
        [pointer] = allocator.allocated
        assert slab.rows.data_ptr() == pointer and slab.rows.shape == (8, 1000)
        assert slab.pinned and slab.device_aliased and slab.registration_rows == 8
        assert slab.memory_path is HostMemoryPath.HOST_ALLOC and int(slab.memory_path) == 1  # the gauge's value
        slab.slot(3).fill_(7)  # the memory is the slab's: writes land there
        assert allocator.allocated[pointer].raw[6000:8000] == b"\x07" * 2000
        [warning] = warnings_logged(caplog)
        assert "CUDA refused to register the 8000-byte host slab" in warning
        assert "cudaErrorNotSupported (801)" in warning and "confidential-computing" in warning  # what was refused
        assert "pinned memory from cudaHostAlloc" in warning and "host memory path 1" in warning  # what instead
        assert "copies run at full speed" in warning and "allocated and pinned now" in warning  # what it costs
    finally:
        slab.close()
    del slab
    assert allocator.freed == [pointer]  # freed once no view remains
    assert runtime.unregistered == []  # nothing was registered, nothing unregistered


def test_a_slab_refused_by_cudahostalloc_too_raises_one_line_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    as_if_on_cuda(monkeypatch, RefusingRuntime(), StandInHostAllocator(code=2))
    with pytest.raises(SlabPinningError) as raised:
        HostSlab(4, 2, 1000)
    message = str(raised.value)
    assert "\n" not in message and "cannot pin the 8000-byte host slab" in message
    assert "cudaHostRegister failed with cudaErrorNotSupported (801)" in message
    assert "cudaHostAlloc failed too with cudaErrorMemoryAllocation (2)" in message


def test_without_libcudart_a_refused_slab_says_there_is_no_cudahostalloc_and_may_stay_pageable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    as_if_on_cuda(monkeypatch, RefusingRuntime(), None)
    with pytest.warns(PageableSlabWarning, match=r"no cudaHostAlloc \(libcudart is not loaded\).*stays pageable"):
        slab = HostSlab(4, 2, 1000, allow_pageable=True)
    assert not slab.pinned and slab.memory_path is HostMemoryPath.PAGEABLE
    slab.close()


def test_adopted_memory_is_never_swapped_for_cudahostalloc_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    allocator = StandInHostAllocator()
    as_if_on_cuda(monkeypatch, RefusingRuntime(), allocator)
    buffer = mmap.mmap(-1, 8 * PAGE)  # page-aligned, as pinning needs
    with pytest.raises(SlabPinningError, match="cudaErrorNotSupported"):
        HostSlab.from_buffer(buffer, 4, 2, PAGE)
    assert allocator.allocated == {}


# --- the shared region: every rank pageable together ---------------------------


@pytest.fixture
def name() -> Iterator[str]:
    made = f"test-{uuid.uuid4().hex[:12]}"
    yield made
    leftover = Path(f"/dev/shm/kvtriton_{made}.region")
    assert not leftover.exists(), f"{leftover} was left behind"


def take_slabs_together(regions: list[SharedRegion]) -> list[HostSlab]:
    """Every rank's slab, rank ``r`` on a thread named ``rank-r`` (a rank pins only once every rank populated)."""
    slabs: list[HostSlab | None] = [None] * len(regions)
    failures: list[BaseException] = []

    def take(rank: int) -> None:
        try:
            slabs[rank] = regions[rank].rank_slab(rank, populate_timeout_s=30)
        except BaseException as error:  # noqa: BLE001 -- reported below, on the test's thread
            failures.append(error)

    threads = [threading.Thread(target=take, args=(rank,), name=f"rank-{rank}") for rank in range(len(regions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == []
    taken = [made for made in slabs if made is not None]
    assert len(taken) == len(regions)
    return taken


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_region_cuda_refuses_to_pin_goes_pageable_on_every_rank_with_one_warning_and_the_gauge_says_so(
    name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, world_size: int
) -> None:
    runtime, allocator = RefusingRuntime(), StandInHostAllocator()
    as_if_on_cuda(monkeypatch, runtime, allocator)
    layout = RegionLayout(4, 2, world_size, PAGE)
    scheduler = SharedRegion(name, layout, world_size + 1)
    regions = [SharedRegion(name, layout, world_size + 1) for _ in range(world_size)]
    slabs: list[HostSlab] = []
    try:
        assert scheduler.memory_path is None  # no rank decided yet
        with caplog.at_level(logging.INFO, logger="kvtriton"):
            slabs = take_slabs_together(regions)
        assert runtime.refusals == world_size and runtime.registered == []
        assert allocator.allocated == {}  # the region is the memory every process shares: nothing else is taken
        assert all(not made.pinned and made.memory_path is HostMemoryPath.PAGEABLE for made in slabs)
        assert scheduler.refused_count == world_size
        assert scheduler.memory_path is HostMemoryPath.PAGEABLE and int(scheduler.memory_path) == 2  # the gauge
        [warning] = warnings_logged(caplog)  # one line for the whole engine, whatever its ranks
        assert (
            f"CUDA refused to pin the shared host region {scheduler.path} for {world_size} of {world_size}" in warning
        )
        assert "cudaErrorNotSupported (801)" in warning and "confidential-computing" in warning  # what was refused
        assert "every rank copies through pageable memory" in warning and "host memory path 2" in warning  # instead
        assert "it costs bandwidth" in warning  # and what that costs
    finally:
        for made in slabs:
            made.close()
        for region in [scheduler, *regions]:
            region.close()


def test_one_refused_rank_sends_every_rank_to_pageable_memory_and_the_pinned_ones_unpin(
    name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = RefusingRuntime(code=2, refused_threads={"rank-2"})  # one rank's driver caps what it pins
    as_if_on_cuda(monkeypatch, runtime, StandInHostAllocator())
    layout = RegionLayout(4, 2, 3, PAGE)
    regions = [SharedRegion(name, layout, 3) for _ in range(3)]
    slabs: list[HostSlab] = []
    try:
        with caplog.at_level(logging.INFO, logger="kvtriton"):
            slabs = take_slabs_together(regions)
        assert len(runtime.registered) == 2  # ranks 0 and 1 had pinned, one registration each...
        assert sorted(runtime.unregistered) == sorted(ptr for ptr, _ in runtime.registered)  # ...and let go
        assert all(made.memory_path is HostMemoryPath.PAGEABLE for made in slabs)
        assert regions[0].memory_path is HostMemoryPath.PAGEABLE and regions[0].refused_count == 1
        [warning] = warnings_logged(caplog)
        assert "for 1 of 3 rank(s)" in warning and "cudaErrorMemoryAllocation (2), first on rank 2" in warning
        followers = [
            record.getMessage() for record in caplog.records if "CUDA refused to pin rank 2's" in record.getMessage()
        ]
        assert len(followers) == 2 and all(
            record.levelno == logging.INFO for record in caplog.records if "rank 2's" in record.getMessage()
        )
    finally:
        for made in slabs:
            made.close()
        for region in regions:
            region.close()


def test_a_region_every_rank_pins_reports_the_registered_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    as_if_on_cuda(monkeypatch, RefusingRuntime(refused_threads=set()), StandInHostAllocator())
    layout = RegionLayout(4, 2, 2, PAGE)
    regions = [SharedRegion(name, layout, 2) for _ in range(2)]
    slabs: list[HostSlab] = []
    try:
        slabs = take_slabs_together(regions)
        assert all(made.pinned and made.memory_path is HostMemoryPath.REGISTERED for made in slabs)
        assert regions[1].memory_path is HostMemoryPath.REGISTERED and int(HostMemoryPath.REGISTERED) == 0
        assert regions[1].refused_count == 0
    finally:
        for made in slabs:
            made.close()
        for region in regions:
            region.close()
