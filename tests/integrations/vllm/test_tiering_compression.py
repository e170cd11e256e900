"""Compressed rows (``kvtriton_kv_compression``) through vLLM's tiered offloading and its ``fs`` tier, on CPU.

The shared region holds compressed block rows, the fs tier stores them as
they are, and the namespace the tiers see names the compression: a
compressed and an uncompressed engine sharing one fs root only miss each
other's chunks, never read them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import torch
from fs_round_trip import loaded_blocks, read_back, store
from tiering_fixtures.configs import key, settle_lookup, tiering_config
from tiering_fixtures.tiered_vllm import BLOCK_SIZE, LAYERS, TieredVLLM, fs_tier, start_tiered_vllm
from vllm.config import ModelConfig
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_fixtures.requests import make_request

from kvtriton._integrity import SEAL_BYTES
from kvtriton.integrations.vllm._tiered_spec import LAYOUT_TAG, KVTritonTieringOffloadingSpec, layout_tag
from kvtriton.kernels._compression import dequantize_groups, quantize_groups

COMPRESSED: dict[str, object] = {"kvtriton_kv_compression": "fp8-e4m3"}
TAG = f"{LAYOUT_TAG}+fp8-e4m3-g128"


def test_the_layout_tag_names_the_compression() -> None:
    assert layout_tag(compression=None) == LAYOUT_TAG
    assert layout_tag(compression="fp8-e4m3-g128") == TAG


def test_the_compressed_spec_sizes_the_region_in_compressed_rows_and_tags_the_tiers_namespace() -> None:
    extra: dict[str, object] = {"cpu_bytes_to_use": 64 * 65536}
    plain = OffloadingSpecFactory.create_spec(tiering_config(extra, worker_kv_bytes_per_block=65536))
    compressed = OffloadingSpecFactory.create_spec(
        tiering_config({**extra, **COMPRESSED}, worker_kv_bytes_per_block=65536)
    )
    assert isinstance(plain, KVTritonTieringOffloadingSpec) and isinstance(compressed, KVTritonTieringOffloadingSpec)
    assert plain.layout_tag == LAYOUT_TAG and compressed.layout_tag == TAG
    assert compressed.tier_facing_spec().config.model.name == f"tiny-tiering@{TAG}@id-{compressed.identity.hex}"
    assert plain.identity.fingerprint != compressed.identity.fingerprint
    assert plain.region_layout.num_chunks == 64 * 65536 // (17 * 4096) == 60  # 16 pages of KV and one for the seal
    assert compressed.region_layout.rank_row_bytes < 65536 // 1.9
    # Each chunk is padded to whole 4 KiB pages (O_DIRECT): 33856 bytes and the seal take 36864.
    assert compressed.region_layout.chunk_bytes == 9 * 4096
    assert compressed.region_layout.num_chunks == 64 * 65536 // (9 * 4096) == 113


def test_a_compressed_and_an_uncompressed_engine_on_one_fs_root_never_read_each_others_chunks(
    managers: list[OffloadingManager], tmp_path: Path
) -> None:
    built: list[TieringOffloadingManager] = []
    for compression in ({}, COMPRESSED):
        extra: dict[str, object] = {"cpu_bytes_to_use": 8 * 4096, "secondary_tiers": [fs_tier(tmp_path)], **compression}
        manager = OffloadingSpecFactory.create_spec(tiering_config(extra, model_name="shared/model")).get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        managers.append(manager)
        built.append(manager)
    plain, compressed = built
    # Both chunks are 4096 bytes (rows pad to a page): only the namespace keeps them apart.
    store(plain, 1, 0x5A)
    store(compressed, 2, 0xC3)
    assert settle_lookup(compressed, key(1), ReqContext(req_id="a")) is LookupResult.MISS
    assert settle_lookup(plain, key(2), ReqContext(req_id="b")) is LookupResult.MISS
    assert read_back(plain, 1)[:-SEAL_BYTES] == bytes([0x5A]) * (4096 - SEAL_BYTES)
    assert read_back(compressed, 2)[:-SEAL_BYTES] == bytes([0xC3]) * (4096 - SEAL_BYTES)
    namespaces = {path.name.removesuffix("_r0") for path in tmp_path.iterdir()}
    assert len(namespaces) == 2 and sum(f"@{TAG}@id-" in name for name in namespaces) == 1, namespaces


def finite_pattern(rank: int, index: int, layer: str, shape: torch.Size) -> torch.Tensor:
    """KV values a model could hold (compression refuses NaN and infinity, which random bit patterns include)."""
    generator = torch.Generator().manual_seed(10_000 * rank + 100 * index + LAYERS.index(layer))
    return (torch.randn(shape, generator=generator) * 3).to(torch.float16)


def fp8_round_trip(block: torch.Tensor) -> torch.Tensor:
    """A block as a compressed store and load give it back (the torch reference, 128 elements a scale)."""
    flat = block.reshape(1, -1)
    codes, scales, bad = quantize_groups(flat, 128)
    assert not bool(bad.any())
    return dequantize_groups(codes, scales, 128, flat.dtype).view(block.shape)


PROMPT = list(range(300, 300 + 4 * BLOCK_SIZE + 3))


def test_a_compressed_prompt_cascaded_to_fs_is_promoted_and_loaded_back_as_the_fp8_round_trip(
    model_config: ModelConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TieredVLLM, "pattern", staticmethod(finite_pattern))
    engine = start_tiered_vllm(
        model_config, {"cpu_bytes_to_use": 8 * 4096, "secondary_tiers": [fs_tier(tmp_path)], **COMPRESSED}
    )
    try:
        worker = engine.workers[0].connector_worker
        assert worker is not None
        engine.serve("first", PROMPT)
        assert engine.cpu.stats().stores == 4
        namespaces = {path.name.removesuffix("_r0") for path in tmp_path.iterdir()}
        assert len(namespaces) == 1 and f"@{TAG}@id-" in next(iter(namespaces)), namespaces
        assert len(list(tmp_path.rglob("*.bin"))) == 4  # every chunk cascaded

        assert engine.scheduler.reset_prefix_cache(reset_connector=True)
        engine.step()
        engine.scrub()
        engine.computed.clear()
        engine.scheduler.add_request(make_request("second", PROMPT))
        loaded = loaded_blocks(engine, "second", 4)
        assert [index for request, index in engine.computed if request == "second"] == []  # every block came from fs
        for index, block in enumerate(loaded):
            for name in LAYERS:
                want = fp8_round_trip(finite_pattern(0, index, name, engine.kvs[0][name][0].shape))
                assert torch.equal(engine.kvs[0][name][block], want), (index, name)
    finally:
        engine.shutdown()


def test_a_vllm_policy_in_front_of_the_tiers_carries_compression_in_the_same_compressed_region(
    managers: list[OffloadingManager],
) -> None:
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager

    extra: dict[str, object] = {
        "cpu_bytes_to_use": 64 * 65536,
        "eviction_policy": "LRUCachePolicy",
        "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies.lru",
        **COMPRESSED,
    }
    spec = OffloadingSpecFactory.create_spec(tiering_config(extra, worker_kv_bytes_per_block=65536))
    assert isinstance(spec, KVTritonTieringOffloadingSpec)
    assert spec.layout_tag == TAG and spec.region_layout.num_chunks == 113  # as with kvtriton's own policy
    manager = spec.get_manager()
    managers.append(manager)
    assert isinstance(manager, TieringOffloadingManager)
    assert isinstance(manager.primary_tier, CPUPrimaryTierOffloadingManager)  # vLLM's manager, kvtriton's rows
    assert manager.primary_tier._num_chunks == 113  # pyright: ignore[reportPrivateUsage] -- vLLM's primary has no public count
