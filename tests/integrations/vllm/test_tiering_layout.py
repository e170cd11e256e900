"""The shared host region's byte layout, against vLLM's own CPU primary tier.

With one GPU block per chunk, kvtriton's block rows hold each rank's bytes
where vLLM's ``SharedOffloadRegion`` holds them, padded further for the seal
at the chunk's end. With several blocks per chunk the bytes are also ordered
differently. Either way a kvtriton chunk is not vLLM's, and the layout tag and
identity in the secondary tiers' namespace keep the two apart: a kvtriton
primary and a vLLM primary sharing an fs root only miss each other's chunks.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import torch
from fs_round_trip import read_back, store
from tiering_fixtures.configs import key, settle_lookup, tiering_config
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvtriton._integrity import SEAL_BYTES
from kvtriton._offload_types import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.integrations.vllm._tiered_spec import LAYOUT_TAG, KVTritonPrimaryTier
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
def test_with_one_block_per_chunk_each_row_holds_vllms_bytes_in_vllms_order_padded_for_the_seal(
    world_size: int,
) -> None:
    stores = {0: [3], 2: [0], 3: [5]}
    ours = kvtriton_region_bytes(world_size, 1, stores)
    theirs = vllm_region_bytes(world_size, 1, stores)
    kv_bytes = world_size * RANK_ROW_BYTES
    ours_chunk, theirs_chunk = len(ours) // NUM_CHUNKS, len(theirs) // NUM_CHUNKS
    assert ours_chunk == RegionLayout(NUM_CHUNKS, 1, world_size, RANK_ROW_BYTES).chunk_bytes
    assert ours_chunk >= kv_bytes + SEAL_BYTES
    for chunk in range(NUM_CHUNKS):
        mine = ours[chunk * ours_chunk : (chunk + 1) * ours_chunk]
        assert mine[:kv_bytes] == theirs[chunk * theirs_chunk : chunk * theirs_chunk + kv_bytes]
        assert not any(mine[kv_bytes:])  # the workers never write the padding, nor the seal's room
    assert any(ours)  # the comparison is not between two empty regions


def test_with_two_blocks_per_chunk_the_bytes_are_ordered_differently_hence_the_layout_tag() -> None:
    stores = {1: [4, 2]}
    ours = kvtriton_region_bytes(2, 2, stores)
    theirs = vllm_region_bytes(2, 2, stores)
    assert ours != theirs
    assert sorted(byte for byte in ours if byte) == sorted(byte for byte in theirs if byte)  # the same bytes


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


def payload(chunk: bytes, manager: TieringOffloadingManager) -> bytes:
    """The KV bytes of a chunk read back: all of vLLM's, all but the seal of kvtriton's."""
    return chunk if type(manager) is TieringOffloadingManager else chunk[:-SEAL_BYTES]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_a_vllm_primary_and_a_kvtriton_primary_sharing_an_fs_root_only_miss_each_others_chunks(
    managers: list[OffloadingManager], tmp_path: Path, blocks_per_chunk: int
) -> None:
    vllm_primary = build(managers, "TieringOffloadingSpec", tmp_path, blocks_per_chunk)
    kvtriton_primary = build(managers, "KVTritonTieringOffloadingSpec", tmp_path, blocks_per_chunk)
    assert isinstance(kvtriton_primary.primary_tier, KVTritonPrimaryTier)
    store(vllm_primary, 1, 0x5A)
    store(kvtriton_primary, 2, 0xC3)
    assert settle_lookup(kvtriton_primary, key(1), ReqContext(req_id="a")) is LookupResult.MISS
    assert settle_lookup(vllm_primary, key(2), ReqContext(req_id="b")) is LookupResult.MISS
    # Each still finds its own chunk, and the two namespaces sit side by side under the root.
    mine = payload(read_back(kvtriton_primary, 2), kvtriton_primary)
    assert mine == bytes([0xC3]) * len(mine)
    theirs = read_back(vllm_primary, 1)
    assert theirs == bytes([0x5A]) * len(theirs)
    namespaces = {path.name.removesuffix("_r0") for path in tmp_path.iterdir()}
    assert len(namespaces) == 2 and sum(f"@{LAYOUT_TAG}@id-" in name for name in namespaces) == 1, namespaces
