"""The shared host region's byte layout, against vLLM's own CPU primary tier.

With one GPU block per chunk, kvtriton's region rows must be byte for byte the
rows of vLLM's ``SharedOffloadRegion``, so a kvtriton primary and a vLLM
primary can share a secondary tier's data. With several blocks per chunk the
bytes are ordered differently, and the layout tag in the secondary tiers'
namespace must keep the two apart: they only miss each other's chunks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import torch
from tiering_fixtures.configs import drain, key, settle_lookup, tiering_config, wait_for_hit
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VLLMCPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.integrations._vllm_tiering import LAYOUT_TAG, KVTritonPrimaryTier
from kvtriton.worker._engine import TransferEngine
from kvtriton.worker._layout import PagedKV
from kvtriton.worker._shared_region import RegionLayout, SharedRegion

PAGE_BYTES = (1536, 512)  # two KV tensors per rank, of unequal page sizes
RANK_ROW_BYTES = sum(PAGE_BYTES)
NUM_GPU_BLOCKS = 6
NUM_CHUNKS = 4


def gpu_pages(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [
        torch.randint(0, 256, (NUM_GPU_BLOCKS, size), generator=generator, dtype=torch.uint8) for size in PAGE_BYTES
    ]


def vllm_region_bytes(world_size: int, blocks_per_chunk: int, chunk_blocks: dict[int, list[int]]) -> bytes:
    """The region bytes vLLM's SharedOffloadRegion holds after its workers store ``chunk -> GPU blocks``.

    vLLM's copy kernels need CUDA; the copy they do is written out here with
    the region's own per-rank views: chunk ``c`` of tensor ``t`` holds that
    tensor's pages of the chunk's blocks, back to back.
    """
    row = -(-world_size * RANK_ROW_BYTES * blocks_per_chunk // 4096) * 4096
    engine_id = f"layout-{uuid.uuid4().hex[:12]}"
    regions = [
        SharedOffloadRegion(engine_id, NUM_CHUNKS, rank, row, RANK_ROW_BYTES * blocks_per_chunk)
        for rank in range(world_size)
    ]
    try:
        for rank, region in enumerate(regions):
            views = [region.create_next_worker_view(size * blocks_per_chunk) for size in PAGE_BYTES]
            for view, page in zip(views, gpu_pages(rank)):
                for chunk, blocks in chunk_blocks.items():
                    view[chunk].copy_(page[blocks].reshape(-1).view(torch.int8))
        return bytes(regions[0].create_kv_memoryview().cast("B"))
    finally:
        for region in regions:
            region.cleanup()


def kvtriton_region_bytes(world_size: int, blocks_per_chunk: int, chunk_blocks: dict[int, list[int]]) -> bytes:
    """The same stores through kvtriton's engine, one rank after the other, into one SharedRegion."""
    layout = RegionLayout(NUM_CHUNKS, blocks_per_chunk, world_size, RANK_ROW_BYTES)
    name = f"layout-{uuid.uuid4().hex[:12]}"
    regions = [SharedRegion(name, layout, world_size) for _ in range(world_size)]
    try:
        for rank, region in enumerate(regions):
            slab = region.rank_slab(rank, pin=False)
            engine = TransferEngine(
                PagedKV(gpu_pages(rank), [f"t{index}" for index in range(len(PAGE_BYTES))]), slab, "torch"
            )
            blocks = [block for chunk in sorted(chunk_blocks) for block in chunk_blocks[chunk]]
            assert engine.submit_store(1, GPULoadStoreSpec(blocks), CPULoadStoreSpec(sorted(chunk_blocks)))
            (result,) = engine.get_finished()
            assert result.success
            engine.shutdown()
            slab.close()
        return regions[0].region_tensor().numpy().tobytes()
    finally:
        for region in regions:
            region.close()


@pytest.mark.parametrize("world_size", [1, 2])
def test_with_one_block_per_chunk_the_region_is_byte_identical_to_vllms(world_size: int) -> None:
    stores = {0: [3], 2: [0], 3: [5]}
    ours = kvtriton_region_bytes(world_size, 1, stores)
    assert ours == vllm_region_bytes(world_size, 1, stores)
    assert any(ours)  # the comparison is not between two empty regions


def test_with_two_blocks_per_chunk_the_bytes_are_ordered_differently_hence_the_layout_tag() -> None:
    stores = {1: [4, 2]}
    ours = kvtriton_region_bytes(2, 2, stores)
    theirs = vllm_region_bytes(2, 2, stores)
    assert ours != theirs
    assert sorted(ours) == sorted(theirs)  # the same bytes, in another order


@pytest.fixture
def managers() -> Iterator[list[OffloadingManager]]:
    made: list[OffloadingManager] = []
    yield made
    for manager in made:
        manager.shutdown()


CHUNK_BLOCK_BYTES = 2048


def build(
    managers: list[OffloadingManager], spec_name: str, root: Path, blocks_per_chunk: int
) -> TieringOffloadingManager:
    extra: dict[str, object] = {
        "cpu_bytes_to_use": 8 * 4096,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "n_read_threads": 1, "n_write_threads": 1}],
    }
    if spec_name == "TieringOffloadingSpec":
        extra.update(spec_name=spec_name, spec_module_path=None)
    config = tiering_config(
        extra, worker_kv_bytes_per_block=CHUNK_BLOCK_BYTES, blocks_per_chunk=blocks_per_chunk, model_name="shared/model"
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    managers.append(manager)
    return manager


def store(manager: TieringOffloadingManager, index: int, fill: int) -> None:
    """Store chunk ``key(index)`` holding ``fill`` bytes, and wait until it is cascaded to fs."""
    context = ReqContext(req_id=f"store-{index}")
    manager.on_new_request(context)
    with manager.lock:
        output = manager.prepare_store([key(index)], context)
    assert output is not None and isinstance(output.store_spec, VLLMCPULoadStoreSpec)
    (slot,) = output.store_spec.chunk_ids.tolist()
    flat = manager.primary_tier.get_kv_memoryview().cast("B")
    size = len(flat) // manager.primary_tier._num_chunks  # pyright: ignore[reportPrivateUsage] -- vLLM's primary has no public count
    flat[slot * size : (slot + 1) * size] = bytes([fill]) * size
    with manager.lock:
        manager.complete_store([key(index)], context)
    drain(manager)
    manager.on_request_finished(context)


def read_back(manager: TieringOffloadingManager, index: int) -> bytes:
    context = ReqContext(req_id=f"load-{index}")
    manager.on_new_request(context)
    wait_for_hit(manager, key(index), context)
    with manager.lock:
        spec = manager.prepare_load([key(index)], context)
    assert isinstance(spec, VLLMCPULoadStoreSpec)
    (slot,) = spec.chunk_ids.tolist()
    flat = manager.primary_tier.get_kv_memoryview().cast("B")
    size = len(flat) // manager.primary_tier._num_chunks  # pyright: ignore[reportPrivateUsage] -- as above
    return bytes(flat[slot * size : (slot + 1) * size])


def test_with_one_block_per_chunk_a_vllm_primary_and_a_kvtriton_primary_share_the_fs_tier(
    managers: list[OffloadingManager], tmp_path: Path
) -> None:
    vllm_primary = build(managers, "TieringOffloadingSpec", tmp_path, 1)
    kvtriton_primary = build(managers, "KVTritonTieringOffloadingSpec", tmp_path, 1)
    assert isinstance(kvtriton_primary.primary_tier, KVTritonPrimaryTier)
    store(vllm_primary, 1, 0x5A)
    assert read_back(kvtriton_primary, 1) == bytes([0x5A]) * 4096
    store(kvtriton_primary, 2, 0xC3)
    assert read_back(vllm_primary, 2) == bytes([0xC3]) * 4096


def test_with_two_blocks_per_chunk_each_primary_only_misses_the_others_chunks(
    managers: list[OffloadingManager], tmp_path: Path
) -> None:
    vllm_primary = build(managers, "TieringOffloadingSpec", tmp_path, 2)
    kvtriton_primary = build(managers, "KVTritonTieringOffloadingSpec", tmp_path, 2)
    store(vllm_primary, 1, 0x5A)
    store(kvtriton_primary, 2, 0xC3)
    assert settle_lookup(kvtriton_primary, key(1), ReqContext(req_id="a")) is LookupResult.MISS
    assert settle_lookup(vllm_primary, key(2), ReqContext(req_id="b")) is LookupResult.MISS
    # Each still finds its own chunk, and the two namespaces sit side by side under the root.
    assert read_back(kvtriton_primary, 2) == bytes([0xC3]) * 4096
    assert read_back(vllm_primary, 1) == bytes([0x5A]) * 4096
    namespaces = {path.name.removesuffix("_r0") for path in tmp_path.iterdir()}
    assert len(namespaces) == 2 and sum(f"@{LAYOUT_TAG}_" in name for name in namespaces) == 1, namespaces
