"""SharedRegion and its per-rank slabs: the /dev/shm region the scheduler and every worker rank map.

Several SharedRegion objects in one process stand in for several processes:
each maps the file on its own, exactly as another process would; one test
uses a real second process to show that a crash leaves nothing behind
(test_tiering_region_lifetime.py has the rest of the file's life: stale,
torn and foreign files).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtriton.worker._shared_region as shared_region
import kvtriton.worker._slab as slab_module
from kvtriton._integrity import SEAL_BYTES
from kvtriton.worker._shared_region import ROW_ALIGNMENT, RegionLayout, SharedRegion
from kvtriton.worker._slab import HostMemoryPath, HostSlab

ROOT = Path(__file__).resolve().parents[3]
HEADER = shared_region.HEADER_BYTES


@pytest.fixture
def name() -> Iterator[str]:
    made = f"test-{uuid.uuid4().hex[:12]}"
    yield made
    leftover = Path(f"/dev/shm/kvtriton_{made}.region")
    assert not leftover.exists(), f"{leftover} was left behind"


def only_the_given_gpu(gpu: int | None) -> int | None:
    """Placement without the current CUDA device: on a GPU machine these tests still place nothing by default."""
    return gpu


def slab(region: SharedRegion, rank: int) -> HostSlab:
    return region.rank_slab(rank, pin=False)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 3, 8])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_chunk_is_a_multiple_of_the_direct_io_alignment_and_holds_every_rank_and_its_seal(
    blocks_per_chunk: int, world_size: int
) -> None:
    layout = RegionLayout(5, blocks_per_chunk, world_size, 1000)
    assert layout.chunk_bytes % ROW_ALIGNMENT == 0
    assert layout.block_row_stride >= world_size * 1000 + SEAL_BYTES
    padding = layout.chunk_bytes - blocks_per_chunk * world_size * 1000
    # The seal's room in every block row, plus under one page per chunk when the block count divides the page;
    # under one page per block row otherwise.
    slack = ROW_ALIGNMENT if ROW_ALIGNMENT % blocks_per_chunk == 0 else blocks_per_chunk * ROW_ALIGNMENT
    assert padding < slack + blocks_per_chunk * SEAL_BYTES
    assert layout.rank_offset(world_size - 1) + 1000 <= layout.block_row_stride
    # The seal is the chunk's last SEAL_BYTES, after the last block row's bytes of every rank.
    last_row_end = (blocks_per_chunk - 1) * layout.block_row_stride + world_size * 1000
    assert layout.seal_offset == layout.chunk_bytes - SEAL_BYTES >= last_row_end
    assert f"sealed in their last {SEAL_BYTES}" in layout.describe()


def test_a_chunk_that_fills_whole_pages_gains_one_page_for_its_seal() -> None:
    assert RegionLayout(5, 1, 1, 2 * ROW_ALIGNMENT).chunk_bytes == 3 * ROW_ALIGNMENT
    assert RegionLayout(5, 1, 1, 2 * ROW_ALIGNMENT - SEAL_BYTES).chunk_bytes == 2 * ROW_ALIGNMENT


def test_a_budget_below_one_chunk_is_refused_naming_both_sizes() -> None:
    # Two block rows of two ranks' 2048 bytes and the seal's room, each padded to 6144: 12288 bytes.
    with pytest.raises(ValueError, match=r"cpu_bytes_to_use=4000 holds no chunk.*64-byte seal.*takes 12288 bytes"):
        RegionLayout.for_budget(4000, 2, 2, 2048)
    assert RegionLayout.for_budget(3 * 12288 + 1, 2, 2, 2048).num_chunks == 3


def test_the_file_is_unlinked_once_every_process_mapped_it_and_all_see_the_same_bytes(name: str) -> None:
    layout = RegionLayout(4, 2, 2, 1000)
    scheduler = SharedRegion(name, layout, 3)
    rank0 = SharedRegion(name, layout, 3)
    assert os.path.exists(scheduler.path) and scheduler.mapped_count == 2
    rank1 = SharedRegion(name, layout, 3)
    assert not os.path.exists(scheduler.path) and rank1.unlinked  # the third mapping completed the count
    slabs = [slab(rank0, 0), slab(rank1, 1)]
    slabs[0].slot(2).fill_(0xA0)
    slabs[1].slot(2).fill_(0xB1)
    chunk = scheduler.region_tensor()[2].view(2, layout.block_row_stride)
    assert chunk[:, :1000].eq(0xA0).all() and chunk[:, 1000:2000].eq(0xB1).all()
    assert chunk[:, 2000:].eq(0).all()  # padding untouched
    assert scheduler.region_tensor()[[0, 1, 3]].eq(0).all()  # other chunks untouched
    view = scheduler.chunk_memoryview()
    assert (view.shape, view.strides) == ((4, layout.chunk_bytes), (layout.chunk_bytes, 1))
    assert bytes(view.cast("B")[2 * layout.chunk_bytes : 2 * layout.chunk_bytes + 2]) == b"\xa0\xa0"
    for made in slabs:
        made.close()
    for region in (scheduler, rank0, rank1):
        region.close()


def test_a_region_whose_processes_never_all_came_is_unlinked_on_close(name: str) -> None:
    region = SharedRegion(name, RegionLayout(2, 1, 1, 4096), 5)
    assert os.path.exists(region.path)
    region.close()
    region.close()  # idempotent
    assert not os.path.exists(region.path)


def test_a_process_that_crashes_after_mapping_leaks_nothing(name: str) -> None:
    layout = RegionLayout(2, 1, 2, 2048)
    scheduler = SharedRegion(name, layout, 2)
    child = (
        "import os\n"
        "from kvtriton.worker._shared_region import RegionLayout, SharedRegion\n"
        f"region = SharedRegion({name!r}, RegionLayout(2, 1, 2, 2048), 2)\n"
        "region.rank_rows(1).fill_(7)\n"
        "os._exit(0)  # no close(): a crash\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", child], check=True, env=env, timeout=120)
    assert not os.path.exists(scheduler.path)
    assert scheduler.rank_rows(1).eq(7).all()  # the bytes it wrote outlive it while the scheduler maps them
    scheduler.close()


def test_dev_shm_too_small_is_refused_before_allocating_naming_both_sizes(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = RegionLayout(1000, 1, 1, 4096 - SEAL_BYTES)  # one page per chunk, the seal included
    monkeypatch.setattr(shared_region, "shm_free_bytes", lambda directory=shared_region.REGION_DIRECTORY: 1 << 20)
    with pytest.raises(
        ValueError, match=r"/dev/shm has 1048576 bytes free but the shared host region needs 4100096 bytes"
    ):
        SharedRegion(name, layout, 2)


def test_a_rank_with_another_layout_is_refused_naming_both(name: str) -> None:
    first = SharedRegion(name, RegionLayout(4, 1, 2, 2048), 3)
    with pytest.raises(
        ValueError,
        match=r"laid out as 4 chunks x 1 block\(s\) x 2 rank\(s\) x 2048 bytes.*expects .*x 1024 bytes.*VLLM_PP_LAYER_PARTITION",
    ):
        SharedRegion(name, RegionLayout(8, 1, 2, 1024), 3)
    first.close()


def test_slab_rows_follow_the_slab_numbering_at_the_ranks_offset(name: str) -> None:
    layout = RegionLayout(3, 2, 2, 512)
    region = SharedRegion(name, layout, 1)
    made = slab(region, 1)
    assert (made.num_slots, made.block_size_factor, made.row_bytes) == (3, 2, 512)
    rows = made.rows
    assert rows.shape == (6, 512) and rows.stride() == (layout.block_row_stride, 1)
    made.slot(1)[1].fill_(9)  # chunk 1, its second block
    whole = region.region_tensor().reshape(-1)
    start = 1 * layout.chunk_bytes + 1 * layout.block_row_stride + 512
    assert whole[start : start + 512].eq(9).all() and int(whole.sum()) == 9 * 512
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin=True needs CUDA"):
            region.rank_slab(0, pin=True)
    made.close()
    region.close()


def test_bad_arguments_are_refused_naming_them(name: str) -> None:
    with pytest.raises(ValueError, match="block_size_factor must be >= 1, got 0"):
        RegionLayout(1, 0, 1, 1)
    with pytest.raises(ValueError, match="rank must be in 0..1, got 2"):
        RegionLayout(1, 1, 2, 1).rank_offset(2)
    with pytest.raises(ValueError, match="name must be a non-empty string without '/'"):
        SharedRegion("a/b", RegionLayout(1, 1, 1, 1), 1)
    with pytest.raises(ValueError, match="directory '/nonexistent' does not exist"):
        SharedRegion(name, RegionLayout(1, 1, 1, 1), 1, directory="/nonexistent")


def test_joiners_never_wait_for_a_slow_populate(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pre-faulting runs near 10 GiB/s: a region of hundreds of GB takes longer than any join timeout. The
    # header is published first and each rank populates its own bytes later, so joiners wait for the header only.
    populating, release = threading.Event(), threading.Event()
    real = shared_region._populate_rank  # pyright: ignore[reportPrivateUsage] -- the step made slow here

    def slow_populate(region: object, fd: int, layout: RegionLayout, rank: int) -> None:
        populating.set()
        assert release.wait(timeout=30)
        real(region, fd, layout, rank)  # pyright: ignore[reportArgumentType] -- the real mmap, passed through

    monkeypatch.setattr(shared_region, "_populate_rank", slow_populate)
    layout = RegionLayout(4, 1, 2, 4096)
    creator = SharedRegion(name, layout, 3)
    slabs: list[HostSlab] = []
    worker = threading.Thread(target=lambda: slabs.append(creator.rank_slab(0, pin=False)))
    worker.start()
    try:
        assert populating.wait(timeout=30)
        joined = SharedRegion(name, layout, 3, join_timeout_s=0.2)  # while rank 0 is still populating
        scheduler = SharedRegion(name, layout, 3, join_timeout_s=0.2)
        assert scheduler.unlinked and joined.mapped_count == 3
    finally:
        release.set()
        worker.join()
    slabs[0].close()
    for region in (joined, scheduler, creator):
        region.close()


def test_the_page_by_page_populate_never_writes_another_ranks_bytes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_region, "_MADV_POPULATE_WRITE", 0x7FFF)  # unknown advice: the pre-5.14 fallback runs
    layout = RegionLayout(3, 2, 2, 1000)  # rank bytes straddle pages: pages are shared between ranks
    region = SharedRegion(name, layout, 1)
    other = slab(region, 1)
    other.rows.fill_(7)
    mine = slab(region, 0)
    assert bool(other.rows.eq(7).all()) and bool(mine.rows.eq(0).all())
    mine.close()
    other.close()
    region.close()


def test_page_spans_cover_a_ranks_bytes_with_whole_pages_merged() -> None:
    starts = np.array([4096 + 100, 4096 + 5000, 4096 + 20000], dtype=np.int64)
    assert shared_region.page_spans(starts, 1000, page=4096) == [(4096, 8192), (20480, 8192)]
    layout = RegionLayout(2, 1, 2, 4096)  # block rows of three pages: two ranks' and the seal's
    assert shared_region.rank_row_starts(layout, 1).tolist() == [HEADER + 4096, HEADER + 4 * 4096]
    assert shared_region.page_spans(shared_region.rank_row_starts(layout, 0), 4096, page=4096) == [
        (HEADER, 4096),
        (HEADER + 3 * 4096, 4096),
    ]


# --- pinning waits for every rank, and each rank pins its own pages ------------------


@dataclass
class CountingRegistrar:
    """Stands in for CUDA's host registration: records each call with the populated count the region held then."""

    region: SharedRegion
    registered: list[tuple[int, int, int]] = field(default_factory=lambda: [])
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 -- the CUDA name
        with self.lock:
            self.registered.append((ptr, size, self.region.populated_count))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 -- the CUDA name
        return 0

    def cudaGetLastError(self) -> int:  # noqa: N802 -- the CUDA name
        return 0


def same_address(host: int) -> int:
    return host  # x86 with a recent driver: the device reaches registered memory at its host address


def as_if_on_cuda(monkeypatch: pytest.MonkeyPatch, region: SharedRegion) -> CountingRegistrar:
    registrar = CountingRegistrar(region)
    monkeypatch.setattr(slab_module, "_cuda_available", lambda: True)
    monkeypatch.setattr(slab_module, "_registrar", lambda: registrar)
    monkeypatch.setattr(slab_module, "_device_pointer", same_address)
    monkeypatch.setattr(slab_module, "placement_gpu", only_the_given_gpu)
    return registrar


PAGE = slab_module.HOST_PAGE_BYTES
# Two ranks of two pages per block row: four-page rows, each rank's two pages apart from the other's.
TWO_PAGE_RANKS = RegionLayout(3, 1, 2, 2 * PAGE)


def take_slabs_together(regions: list[SharedRegion]) -> list[HostSlab]:
    """Every rank's pinned slab, each rank on a thread of its own (a rank pins only once every rank populated)."""
    slabs: list[HostSlab | None] = [None] * len(regions)

    def take(rank: int) -> None:
        slabs[rank] = regions[rank].rank_slab(rank)

    threads = [threading.Thread(target=take, args=(rank,)) for rank in range(len(regions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    taken = [made for made in slabs if made is not None]
    assert len(taken) == len(regions), "a rank did not take its slab"
    return taken


def test_each_rank_pins_only_after_every_rank_populated_in_one_registration_of_whole_rows(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    regions = [SharedRegion(name, TWO_PAGE_RANKS, 2) for _ in range(2)]
    registrar = as_if_on_cuda(monkeypatch, regions[0])
    slabs: list[HostSlab] = []
    try:
        # Rank 0 arrives first and waits on its thread; rank 1 arrives later, here.
        first = threading.Thread(target=lambda: slabs.append(regions[0].rank_slab(0)))
        first.start()
        slabs.append(regions[1].rank_slab(1))
        first.join(timeout=30)
        assert not first.is_alive() and len(slabs) == 2
        assert regions[0].populated_count == 2
        assert {populated for _, _, populated in registrar.registered} == {2}  # nobody pinned before both populated
        stride = TWO_PAGE_RANKS.block_row_stride
        assert stride == 5 * PAGE  # two ranks of two pages, and a page for the seal
        for region in regions:
            rows = region.region_tensor().data_ptr()
            mine = [(ptr - rows, size) for ptr, size, _ in registrar.registered if rows <= ptr < rows + stride * 3]
            # One registration of the three whole block rows (the other rank's pages and the seals' too), not
            # three of this rank's two pages.
            assert mine == [(0, 3 * stride)]
        assert all(made.pinned and made.registration_rows == 3 for made in slabs)
        assert regions[0].memory_path is HostMemoryPath.REGISTERED
    finally:
        for made in slabs:
            made.close()
        for region in regions:
            region.close()


@pytest.mark.parametrize(
    ("world_size", "blocks_per_chunk"),
    [(1, 2), (1, 3), (2, 2), (2, 3), (4, 4)],  # one rank with even and odd blocks per chunk; two and four ranks
)
def test_each_rank_pins_the_region_in_one_registration_per_pin_chunk_whatever_the_ranks_and_blocks_per_chunk(
    name: str, monkeypatch: pytest.MonkeyPatch, world_size: int, blocks_per_chunk: int
) -> None:
    # Page-sized rank rows: with one rank and an odd number of blocks per chunk the seal's padding fills a page
    # after every row, and with several ranks every rank's rows sit a block row apart. Either used to cost one
    # cudaHostRegister per block row (here 48 to 64 per rank; tens of thousands for a 100 GB region).
    layout = RegionLayout(16, blocks_per_chunk, world_size, PAGE)
    pieces_of_chunks = 4
    monkeypatch.setattr(slab_module, "PIN_CHUNK_BYTES", pieces_of_chunks * layout.chunk_bytes)
    regions = [SharedRegion(name, layout, world_size) for _ in range(world_size)]
    registrar = as_if_on_cuda(monkeypatch, regions[0])
    slabs: list[HostSlab] = []
    try:
        slabs = take_slabs_together(regions)
        for rank, region in enumerate(regions):
            rows = region.region_tensor().data_ptr()
            mine = sorted(
                (ptr - rows, size) for ptr, size, _ in registrar.registered if rows <= ptr < rows + layout.region_bytes
            )
            piece = pieces_of_chunks * layout.chunk_bytes
            # 16 chunks in pieces of 4: four registrations per rank, one after the other, covering every row.
            assert mine == [(offset, piece) for offset in range(0, layout.region_bytes, piece)]
            assert slabs[rank].registration_rows == pieces_of_chunks * blocks_per_chunk
        assert len(registrar.registered) == 4 * world_size
    finally:
        for made in slabs:
            made.close()
        for region in regions:
            region.close()


def test_a_rank_that_never_arrives_times_out_naming_the_count_and_nothing_is_pinned(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    regions = [SharedRegion(name, TWO_PAGE_RANKS, 2) for _ in range(2)]
    registrar = as_if_on_cuda(monkeypatch, regions[0])
    try:
        with pytest.raises(TimeoutError, match=r"rank 0 waited 0.05 s for every rank .* only 1 of 2 did"):
            regions[0].rank_slab(0, populate_timeout_s=0.05)
        assert registrar.registered == []
        # Rank 1 takes a pageable slab: it counts itself in without waiting (a wait would time out at once).
        regions[1].rank_slab(1, pin=False, populate_timeout_s=0).close()
        with regions[0].rank_slab(0, populate_timeout_s=0) as pinned:  # rank 0 again: counted once, not twice
            assert pinned.pinned and regions[0].populated_count == 2
    finally:
        for region in regions:
            region.close()


def test_a_bad_populate_timeout_is_refused_before_any_work(name: str) -> None:
    region = SharedRegion(name, TWO_PAGE_RANKS, 1)
    try:
        for bad in (-1.0, float("nan"), "10", True):
            with pytest.raises(ValueError, match="populate_timeout_s must be a number of seconds >= 0"):
                region.rank_slab(0, pin=False, populate_timeout_s=bad)  # pyright: ignore[reportArgumentType] -- bad on purpose
        assert region.populated_count == 0
    finally:
        region.close()
