"""The shared region on a real GPU: pinned per-rank slabs and the compiled kernels (skipped without CUDA).

The CPU suite checks the layout with the torch backend; here two ranks' GPU
pages are stored into one pinned region by the Triton kernels and loaded back,
and the region's bytes must equal what the CPU reference put in a second
region from the same pages. Each rank waits at most
:data:`RANK_POPULATE_TIMEOUT_S` for the other (not the region's default 600 s),
so one rank that fails stalls ``bench/gpu_check.sh``'s CUDA step for seconds,
not for the rest of its budget.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.worker._engine import TransferEngine
from kvtriton.worker._layout import PagedKV
from kvtriton.worker._shared_region import POPULATE_TIMEOUT_S, RegionLayout, SharedRegion
from kvtriton.worker._slab import HostSlab

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PAGE_BYTES = (3072, 1024)
NUM_GPU_BLOCKS = 16
RANK_POPULATE_TIMEOUT_S = 20.0
"""How long a rank waits for the other to populate the region before it pins: both start together, in threads of
this process, so a rank that has not arrived within this has failed (its error is raised beside the timeout)."""


def pages(rank: int, device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [
        torch.randint(0, 256, (NUM_GPU_BLOCKS, size), generator=generator, dtype=torch.uint8).to(device)
        for size in PAGE_BYTES
    ]


def fill(layout: RegionLayout, device: str, backend: str) -> tuple[bytes, list[list[torch.Tensor]]]:
    """Store blocks 3..10 of both ranks into the first slots, then load them into blocks 0..7; the region bytes and pages."""
    name = f"cuda-{uuid.uuid4().hex[:12]}"
    regions = [SharedRegion(name, layout, layout.world_size) for _ in range(layout.world_size)]
    kept: list[list[torch.Tensor]] = []
    slots = CPULoadStoreSpec(list(range(8 // layout.block_size_factor)))
    try:
        # A rank pins only once every rank has populated, so the ranks take their slabs together.
        def take(rank: int) -> HostSlab:
            return regions[rank].rank_slab(rank, pin=device == "cuda", populate_timeout_s=RANK_POPULATE_TIMEOUT_S)

        with ThreadPoolExecutor(layout.world_size) as pool:
            slabs = list(pool.map(take, range(layout.world_size)))
        for rank, slab in enumerate(slabs):
            assert slab.pinned is (device == "cuda")
            rank_pages = pages(rank, device)
            engine = TransferEngine(PagedKV(rank_pages, ["k", "v"]), slab, backend)
            assert engine.submit_store(1, GPULoadStoreSpec(list(range(3, 11))), slots)
            engine.wait({1})
            assert engine.submit_load(2, slots, GPULoadStoreSpec(list(range(8))))
            engine.wait({2})
            assert all(result.success for result in engine.get_finished())
            engine.shutdown()
            slab.close()
            kept.append([page.cpu() for page in rank_pages])
        return regions[0].region_tensor().numpy().tobytes(), kept
    finally:
        for region in regions:
            region.close()


@needs_cuda
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_two_ranks_store_into_one_pinned_region_with_the_kernels_as_the_cpu_reference_does(
    blocks_per_chunk: int,
) -> None:
    layout = RegionLayout(16 // blocks_per_chunk, blocks_per_chunk, 2, sum(PAGE_BYTES))
    on_gpu, gpu_pages = fill(layout, "cuda", "triton")
    on_cpu, cpu_pages = fill(layout, "cpu", "torch")
    assert on_gpu == on_cpu
    for rank in range(2):
        for gpu_page, cpu_page in zip(gpu_pages[rank], cpu_pages[rank]):
            assert torch.equal(gpu_page[:8], cpu_page[:8])  # loaded back: blocks 0..7 now hold blocks 3..10


def test_each_rank_waits_for_the_other_seconds_not_the_regions_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs without a GPU: the helper the GPU test shares with the CPU reference asks every rank for the short wait."""
    asked: list[object] = []
    take_slab = SharedRegion.rank_slab

    def recording(region: SharedRegion, rank: int, **options: object) -> HostSlab:
        asked.append(options.get("populate_timeout_s", POPULATE_TIMEOUT_S))
        return take_slab(region, rank, **options)  # pyright: ignore[reportArgumentType] -- passed through as given

    monkeypatch.setattr(SharedRegion, "rank_slab", recording)
    layout = RegionLayout(8, 2, 2, sum(PAGE_BYTES))
    fill(layout, "cpu", "torch")
    assert asked == [RANK_POPULATE_TIMEOUT_S, RANK_POPULATE_TIMEOUT_S]
    assert RANK_POPULATE_TIMEOUT_S <= POPULATE_TIMEOUT_S / 10
