"""The tiered spec keeps a just-hit prefix over untouched blocks, through vLLM's own ``TieringOffloadingManager``.

vLLM 0.33's orchestrator never passes ``on_new_request`` on to its primary
tier, so kvtriton's primary must rank requests it was never told about, from
the token positions in vLLM's context and the end of each request, as vLLM's
own CPU manager does. The scenario is the issue that found the difference:
four requests into four slots -- r1 stores A, B; r2 stores C, D; r3 loads A,
B; r4 stores E, F -- must evict C and D (r2's tail first), under LRU and ARC,
as vLLM alone, vLLM tiered and kvtriton's single-tier spec all do.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from tiering_fixtures.configs import key, tiering_config
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VLLMCPUOffloadingManager
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_fixtures.builders import SHARED_POLICIES

from kvtriton.integrations.vllm import KVTritonTieringOffloadingSpec
from kvtriton.integrations.vllm._tiered_spec import KVTritonPrimaryTier

CHUNK = 4096  # 2048-byte blocks, one rank, padded to 4096 bytes
A, B, C, D, E, F = (key(index) for index in range(1, 7))


def kvtriton_tiered(managers: list[OffloadingManager], policy: str, slots: int = 4) -> TieringOffloadingManager:
    spec = OffloadingSpecFactory.create_spec(
        tiering_config({"cpu_bytes_to_use": slots * CHUNK, "eviction_policy": policy})
    )
    assert isinstance(spec, KVTritonTieringOffloadingSpec)
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager) and isinstance(manager.primary_tier, KVTritonPrimaryTier)
    managers.append(manager)
    return manager


def request(req_id: str, *keys: OffloadKey) -> ReqContext:
    """vLLM's context for a request whose prompt is ``keys``, their end tokens recorded as vLLM's scheduler does."""
    context = ReqContext(req_id=req_id)
    for index, offload_key in enumerate(keys):
        context.set_offload_key_position(offload_key, 16 * (index + 1))
    return context


def store(manager: OffloadingManager, context: ReqContext, keys: list[OffloadKey]) -> list[OffloadKey]:
    """One store job of the connector: prepare, the worker's copy, completion; returns the evictions."""
    with manager.lock:
        output = manager.prepare_store(keys, context)
        assert output is not None
        manager.complete_store(output.keys_to_store, context)
    return list(output.evicted_keys)


def load(manager: OffloadingManager, context: ReqContext, keys: list[OffloadKey]) -> None:
    with manager.lock:
        assert [manager.lookup(offload_key, context) for offload_key in keys] == [LookupResult.HIT] * len(keys)
        manager.prepare_load(keys, context)
        manager.complete_load(keys, context)


def four_requests(manager: OffloadingManager) -> list[OffloadKey]:
    """r1 stores A, B; r2 stores C, D; r3 loads A, B; r4 stores E, F: what r4's store evicts."""
    r1, r2, r3, r4 = request("r1", A, B), request("r2", C, D), request("r3", A, B), request("r4", E, F)
    for context in (r1, r2, r3, r4):
        with manager.lock:
            manager.on_new_request(context)  # the orchestrator keeps it from its primary
    store(manager, r1, [A, B])
    with manager.lock:
        manager.on_request_finished(r1)
    store(manager, r2, [C, D])
    with manager.lock:
        manager.on_request_finished(r2)
    load(manager, r3, [A, B])
    with manager.lock:
        manager.on_request_finished(r3)
    return store(manager, r4, [E, F])


@pytest.mark.parametrize("policy", SHARED_POLICIES)
def test_the_tiered_spec_keeps_the_prefix_just_hit_and_evicts_the_untouched_blocks(
    managers: list[OffloadingManager], policy: str
) -> None:
    assert four_requests(kvtriton_tiered(managers, policy)) == [D, C]


@pytest.mark.parametrize("policy", SHARED_POLICIES)
def test_the_four_requests_evict_what_vllms_own_manager_evicts(managers: list[OffloadingManager], policy: str) -> None:
    vllm_alone = VLLMCPUOffloadingManager(num_chunks=4, cache_policy=policy)
    assert four_requests(kvtriton_tiered(managers, policy)) == four_requests(vllm_alone)


@pytest.mark.parametrize("policy", SHARED_POLICIES)
def test_a_running_requests_store_batches_evict_what_vllms_own_manager_evicts(
    managers: list[OffloadingManager], policy: str
) -> None:
    # One long request stores its prompt in batches into too few slots. LRU ranks its blocks together at
    # its start, by token position, so the deepest cached block goes first, batch after batch; ARC keeps
    # T1 in arrival order. Either way, as vLLM's own manager does.
    prompt = [key(index) for index in range(10, 16)]
    evictions: list[list[list[OffloadKey]]] = []
    for offloading in (
        kvtriton_tiered(managers, policy, slots=3),
        VLLMCPUOffloadingManager(num_chunks=3, cache_policy=policy),
    ):
        context = request("long", *prompt)
        with offloading.lock:
            offloading.on_new_request(context)
        evictions.append([store(offloading, context, prompt[start : start + 2]) for start in range(0, 6, 2)])
    ours, vllms = evictions
    assert ours == vllms
    if policy == "lru":
        assert ours == [[], [prompt[1]], [prompt[3], prompt[2]]]


@pytest.mark.parametrize("policy", SHARED_POLICIES)
def test_pins_of_cascades_and_loads_stack_and_only_the_last_release_makes_a_chunk_evictable(
    managers: list[OffloadingManager], policy: str
) -> None:
    # vLLM's pin-count-during-cascade scenario, through evictions: two secondary tiers read chunk A while
    # the GPU loads it; A stays until every pin is released, and the reads never make it recent.
    primary = kvtriton_tiered(managers, policy, slots=2).primary_tier
    assert isinstance(primary, KVTritonPrimaryTier)
    writer = request("writer", A, B)
    assert store(primary, writer, [A, B]) == []
    tiers = ReqContext(req_id="writer")
    primary.prepare_read([A], tiers)
    primary.prepare_read([A], tiers)
    reader = request("reader", A)
    primary.prepare_load([A], reader)
    assert store(primary, request("c", C), [C]) == [B]  # A is pinned three times
    primary.complete_read([A], tiers)
    primary.complete_load([A], reader)
    assert store(primary, request("d", D), [D]) == [C]  # one read still pins A
    primary.complete_read([A], tiers)
    assert store(primary, request("e", E), [E]) == [A]  # unpinned, and never made recent by the reads
