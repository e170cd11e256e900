"""The primary-tier contract vLLM's TieringOffloadingManager relies on, answered by KVTritonPrimaryTier.

vLLM's orchestrator calls its primary tier beyond the manager interface
(promotions write into it, cascades read from it) and reads a few attributes
of vLLM's own CPU primary. These tests hold kvtriton's primary to each of
those expectations, through the spec vLLM builds.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from tiering_fixtures.configs import drain, key, primary_of, settle_lookup, tiering, tiering_config, wait_for_hit
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, OffloadKey, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.config import OffloadingGroupConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VLLMCPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import TIER_LABEL
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm_fixtures.builders import SHARED_POLICIES

from kvtriton._integrity import SEAL_BYTES, seal
from kvtriton.integrations.vllm import KVTritonTieringOffloadingSpec
from kvtriton.integrations.vllm._sealed_tiering import SealedTieringManager
from kvtriton.integrations.vllm._tiered_spec import LAYOUT_TAG

CHUNK = 4096  # 2048-byte blocks, one rank and a seal, padded to 4096 bytes
PAYLOAD = CHUNK - SEAL_BYTES


def sealed_manager(manager: TieringOffloadingManager) -> SealedTieringManager:
    assert isinstance(manager, SealedTieringManager)
    return manager


BUDGET_1M: dict[str, object] = {"cpu_bytes_to_use": 1 << 20}


def test_vllms_factory_loads_the_tiered_spec_by_name_from_the_integration_module() -> None:
    spec_cls = OffloadingSpecFactory.get_spec_cls(
        {"spec_name": "KVTritonTieringOffloadingSpec", "spec_module_path": "kvtriton.integrations.vllm"}
    )
    assert spec_cls is KVTritonTieringOffloadingSpec
    assert issubclass(spec_cls, TieringOffloadingSpec)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_with_one_block_per_chunk_and_room_for_the_seal_in_the_padding_the_geometry_is_vllms_own(
    world_size: int,
) -> None:
    extra: dict[str, object] = {"cpu_bytes_to_use": 1 << 20}
    ours = KVTritonTieringOffloadingSpec(tiering_config(extra, worker_kv_bytes_per_block=1000, world_size=world_size))
    theirs = TieringOffloadingSpec(
        tiering_config(
            {**extra, "spec_name": "TieringOffloadingSpec"}, worker_kv_bytes_per_block=1000, world_size=world_size
        )
    )
    geometry = operator.attrgetter("num_chunks", "kv_bytes_per_chunk", "cpu_page_size_per_worker")
    assert geometry(ours) == geometry(theirs)
    assert ours.layout_tag == LAYOUT_TAG  # the bytes still differ: kvtriton's chunk ends in its seal


def test_a_promotion_slot_stays_pending_until_written_and_is_freed_when_the_write_fails(
    managers: list[OffloadingManager],
) -> None:
    primary = primary_of(tiering(managers, {"cpu_bytes_to_use": 4 * CHUNK}))
    context = ReqContext(req_id="r")
    output = primary.prepare_write([key(1), key(2)], context)
    assert output is not None and isinstance(output.store_spec, VLLMCPULoadStoreSpec)
    assert sorted(output.store_spec.chunk_ids.tolist()) == [0, 1]
    assert primary.lookup(key(1), context) is LookupResult.HIT_PENDING
    primary.complete_write([key(1)], context, True)
    primary.complete_write([key(2)], context, False)
    assert primary.lookup(key(1), context) is LookupResult.HIT
    assert (
        primary.lookup(key(2), context) is LookupResult.MISS
    )  # never RETRY: the orchestrator asks the tiers only on MISS
    assert primary.cpu.stats().used == 1


def test_a_cascade_read_pins_without_counting_an_access_and_reads_stack(
    managers: list[OffloadingManager],
) -> None:
    primary = primary_of(tiering(managers, {"cpu_bytes_to_use": 2 * CHUNK, "eviction_policy": "lru"}))
    context = ReqContext(req_id="r")
    for index in (1, 2):
        output = primary.prepare_store([key(index)], context)
        assert output is not None
        primary.complete_store([key(index)], context)
    # Two tiers read chunk 2 at once; one finishes.
    primary.prepare_read([key(2)], context)
    primary.prepare_read([key(2)], context)
    primary.complete_read([key(2)], context)
    output = primary.prepare_store([key(3)], context)
    assert output is not None and output.evicted_keys == [key(1)]  # chunk 2 is still pinned by the other read
    primary.complete_store([key(3)], context)
    primary.complete_read([key(2)], context)
    # The reads did not make chunk 2 recent: it is now the least recently used and goes next.
    output = primary.prepare_store([key(4)], context)
    assert output is not None and output.evicted_keys == [key(2)]


def test_the_primary_exposes_the_region_and_the_facts_the_orchestrator_reads(
    managers: list[OffloadingManager], tmp_path: Path
) -> None:
    manager = tiering(
        managers,
        {
            "cpu_bytes_to_use": 5 * CHUNK,
            "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 1, "n_write_threads": 1}],
        },
    )
    primary = primary_of(manager)
    view = primary.get_kv_memoryview()
    assert (view.shape, view.strides) == ((5, CHUNK), (CHUNK, 1))
    assert primary._num_chunks == 5  # pyright: ignore[reportPrivateUsage] -- the attribute vLLM's orchestrator reads
    infos = manager.config_info()
    assert [info[TIER_LABEL] for info in infos] == ["0:primary", "1:fs"]
    assert infos[0]["cpu_num_chunks"] == 5 and infos[0]["cpu_kv_cache_size_bytes"] == 5 * CHUNK

    context = ReqContext(req_id="r")
    manager.on_new_request(context)
    with manager.lock:
        output = manager.prepare_store([key(1), key(2)], context)
    assert output is not None
    stats = manager.get_stats()
    assert stats is not None
    assert stats.reduce()[CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC] == pytest.approx(
        2 / 5
    )  # occupancy, under vLLM's names
    slots = output.store_spec
    assert isinstance(slots, VLLMCPULoadStoreSpec)
    flat = view.cast("B")
    for slot, fill in zip(slots.chunk_ids.tolist(), (7, 9)):
        flat[slot * CHUNK : (slot + 1) * CHUNK] = bytes([fill]) * CHUNK
    with manager.lock:
        manager.complete_store([key(1), key(2)], context)  # cascades both chunks to fs
    drain(manager)
    files = sorted(tmp_path.rglob("*.bin"))
    fingerprint = sealed_manager(manager).identity.fingerprint
    sealed = [
        seal(bytes([fill]) * PAYLOAD, key=key(index), fingerprint=fingerprint) for index, fill in ((1, 7), (2, 9))
    ]
    assert sorted(path.read_bytes() for path in files) == sealed  # the cascade sealed each chunk's last bytes
    manager.on_request_finished(context)

    # Forget the host copy; the lookup finds the chunk in fs and promotes it into a pending slot.
    with manager.lock:
        manager.reset_cache()
        manager.on_reset_flushed()
    other = ReqContext(req_id="s")
    manager.on_new_request(other)
    assert settle_lookup(manager, key(2), other) is LookupResult.HIT_PENDING
    wait_for_hit(manager, key(2), other)
    with manager.lock:
        spec = manager.prepare_load([key(2)], other)
    assert isinstance(spec, VLLMCPULoadStoreSpec)
    (slot,) = spec.chunk_ids.tolist()
    assert bytes(flat[slot * CHUNK : (slot + 1) * CHUNK]) == sealed[1]


def test_the_secondary_tiers_namespace_names_the_layout_and_the_identity() -> None:
    one_block = KVTritonTieringOffloadingSpec(tiering_config(BUDGET_1M))
    assert one_block.tier_facing_spec().config.model.name == f"tiny-tiering@{LAYOUT_TAG}@id-{one_block.identity.hex}"
    two_blocks = KVTritonTieringOffloadingSpec(tiering_config(BUDGET_1M, blocks_per_chunk=2))
    tagged = two_blocks.tier_facing_spec()
    assert tagged.config.model.name == f"tiny-tiering@{LAYOUT_TAG}@id-{two_blocks.identity.hex}"
    assert two_blocks.identity.fingerprint != one_block.identity.fingerprint
    assert two_blocks.config.model.name == "tiny-tiering"  # only the tiers' copy is renamed
    assert tagged.blocks_per_chunk == 2 and tagged.config.parallel == two_blocks.config.parallel
    config = tiering_config(BUDGET_1M)
    window = OffloadingGroupConfig(
        tokens_per_block=16, layer_names=("layer1",), group_id=1, sliding_window_size_in_chunks=2
    )
    hybrid = KVTritonTieringOffloadingSpec(dataclasses.replace(config, groups=(*config.groups, window)))
    assert hybrid.layout_tag == LAYOUT_TAG


def test_a_vllm_policy_runs_vllms_primary_over_kvtritons_region(
    managers: list[OffloadingManager], caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager

    extra: dict[str, object] = {
        "cpu_bytes_to_use": 4 * CHUNK,
        "eviction_policy": "LRUCachePolicy",
        "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies.lru",
    }
    with caplog.at_level(logging.INFO, logger="kvtriton.integrations.vllm._tiered_spec"):
        manager = tiering(managers, extra)
    assert "vLLM's own CPUPrimaryTierOffloadingManager ranks and evicts the primary tier" in caplog.text
    primary = manager.primary_tier
    assert type(primary) is CPUPrimaryTierOffloadingManager
    # The chunks vLLM's manager hands out index kvtriton's region: the view the secondary tiers copy.
    view = primary.get_kv_memoryview()
    assert (view.shape, view.nbytes) == ((4, CHUNK), 4 * CHUNK)
    context = ReqContext(req_id="r")
    output = primary.prepare_store([key(1), key(2)], context)
    assert output is not None and isinstance(output.store_spec, VLLMCPULoadStoreSpec)
    assert sorted(output.store_spec.chunk_ids.tolist()) == [0, 1]
    primary.complete_store([key(1), key(2)], context)
    assert primary.lookup(key(1), context) is LookupResult.HIT


VLLM_LRU: dict[str, object] = {
    "eviction_policy": "LRUCachePolicy",
    "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies.lru",
}
"""vLLM's own LRU by module path: the tiered spec then runs vLLM's CPUPrimaryTierOffloadingManager, the reference."""


def _cascade_pins_trace(managers: list[OffloadingManager], policy: dict[str, object]) -> list[object]:
    extra: dict[str, object] = {
        "cpu_bytes_to_use": 4 * CHUNK,
        "secondary_tiers": [{"type": "example"}, {"type": "example"}],
        **policy,
    }
    manager = tiering(managers, extra)
    # Sealed on this thread, so that a cascade reaches its tiers within complete_store, as in vLLM's own test; the
    # seal thread hands it over at the first end of a step after its seal instead (never sooner), a step the trace
    # could not pin down (test_tiering_seal_thread.py covers that).
    sealed_manager(manager).seal_off_thread = False
    context = ReqContext(req_id="r")
    manager.on_new_request(context)
    trace: list[object] = []

    def store(*indices: int) -> None:
        keys = [key(index) for index in indices]
        output = manager.prepare_store(keys, context)
        # How many, not which: which chunk goes is the eviction policy's (tested in the manager's tests).
        trace.append(None if output is None else (len(output.keys_to_store), len(output.evicted_keys)))
        if output is not None:
            manager.complete_store(output.keys_to_store, context, True)

    store(1, 2, 3)
    store(4, 5)  # same step: two tiers still cascading 1..3
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    store(6, 7, 8)
    drain(manager)
    store(9, 10, 11, 12)
    return trace


def test_cascade_pins_release_chunks_to_eviction_exactly_when_vllms_primary_does(
    managers: list[OffloadingManager],
) -> None:
    """vLLM's test_ref_cnt_protection_during_cascade, through what is stored and evicted instead of private pin counts:
    kvtriton's primary and vLLM's own (same LRU rule) give the same answers step by step while two tiers cascade."""
    ours = _cascade_pins_trace(managers, {})
    theirs = _cascade_pins_trace(managers, VLLM_LRU)
    assert ours == theirs
    assert ours[-1] == (4, 4)  # after the cascades drained, four new chunks evict the four held ones


def _four_requests_evicted(managers: list[OffloadingManager], policy: dict[str, object]) -> list[OffloadKey]:
    """r1 stores A,B; r2 stores C,D; r3 loads A,B; r4 stores E,F into four chunks: what r4's store evicts."""
    manager = tiering(managers, {"cpu_bytes_to_use": 4 * CHUNK, **policy})
    step_end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    evicted: list[OffloadKey] = []
    for name, keys, load in (("r1", [1, 2], False), ("r2", [3, 4], False), ("r3", [1, 2], True), ("r4", [5, 6], False)):
        context = ReqContext(req_id=name)
        manager.on_new_request(context)  # the orchestrator's own bookkeeping: it does not pass this to its primary
        for position, index in enumerate(keys, 1):
            context.set_offload_key_position(key(index), position * 16)
        chunks = [key(index) for index in keys]
        if load:
            manager.prepare_load(chunks, context)
            manager.complete_load(chunks, context)
        else:
            output = manager.prepare_store(chunks, context)
            assert output is not None
            evicted += output.evicted_keys
            manager.complete_store(chunks, context, True)
        manager.on_request_finished(context)
        manager.on_schedule_end(step_end)
    return evicted


@pytest.mark.parametrize("policy", SHARED_POLICIES)
def test_the_tiered_spec_keeps_a_just_hit_prefix_over_untouched_chunks(
    managers: list[OffloadingManager], policy: str
) -> None:
    """vLLM's tiered manager never announces a request to its primary: recency must not depend on it."""
    assert sorted(_four_requests_evicted(managers, {"eviction_policy": policy})) == [key(3), key(4)]
    assert sorted(_four_requests_evicted(managers, VLLM_LRU)) == [key(3), key(4)]  # vLLM's own primary
