"""The manager adapter answers vLLM's OffloadingConnector scheduler the way vLLM's CPU manager does.

Each test drives the calls the connector makes, in its order (see
docs/vllm.md and vLLM's offloading/scheduler.py): on_new_request, lookup chunk
by chunk, prepare_load + get_load_source, prepare_store, complete_store /
complete_load when the workers report, take_events, get_stats, reset_cache.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VLLMCPUOffloadingManager
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm_fixtures.builders import SHARED_POLICIES, offloading_config

import kvtriton
from kvtriton.integrations.vllm import KVTritonOffloadingSpec
from kvtriton.integrations.vllm import _surface as surface

BLOCK_BYTES = 1024


def make_manager(num_slots: int = 4, enable_events: bool = True, **extra: object) -> OffloadingManager:
    """The manager vLLM's scheduler would get from a spec holding ``num_slots`` one-block chunks."""
    settings: Mapping[str, object] = {"cpu_bytes_to_use": num_slots * BLOCK_BYTES, **extra}
    spec = KVTritonOffloadingSpec(
        offloading_config(settings, worker_kv_bytes_per_block=BLOCK_BYTES, enable_events=enable_events)
    )
    return spec.get_manager()


def to_keys(ids: list[int]) -> list[OffloadKey]:
    """One key per chunk id, as vLLM builds them (chunk hash + group 0)."""
    return [make_offload_key(i.to_bytes(8, "big"), 0) for i in ids]


def slots(spec: object) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec), f"expected vLLM's CPULoadStoreSpec, got {type(spec).__name__}"
    return spec.block_ids.tolist()


def lookups(manager: OffloadingManager, keys: list[OffloadKey], context: ReqContext) -> list[LookupResult]:
    with manager.lock:
        return [manager.lookup(key, context) for key in keys]


def test_a_new_request_is_offloaded_chunk_by_chunk_and_its_record_lives_in_vllms_context() -> None:
    from kvtriton.manager._request_access import RequestAccess

    manager = make_manager()
    context = ReqContext(req_id="r1", kv_transfer_params={"a": 1})
    answer = manager.on_new_request(context)
    assert answer.policy is OffloadPolicy.CHUNK_LEVEL
    # vLLM's own context is passed through: no kvtriton context is made for it.
    assert context.get_state(kvtriton.ReqContext) is None
    assert isinstance(context.get_state(RequestAccess), RequestAccess)


def test_store_then_load_follows_the_state_machine_the_connector_relies_on() -> None:
    manager = make_manager()
    context = ReqContext(req_id="r1")
    manager.on_new_request(context)
    k1, k2, k3 = to_keys([1, 2, 3])

    assert lookups(manager, [k1], context) == [LookupResult.MISS]
    stored = manager.prepare_store([k1, k2], context)
    assert stored is not None
    assert (stored.keys_to_store, slots(stored.store_spec), stored.evicted_keys) == ([k1, k2], [0, 1], [])
    assert isinstance(stored.store_spec, CPULoadStoreSpec)
    assert str(stored.store_spec.block_ids.dtype) == "int32"  # what vLLM's own CPU spec carries
    # Stored but not written yet: the connector defers the request.
    assert lookups(manager, [k1, k2, k3], context) == [
        LookupResult.HIT_PENDING,
        LookupResult.HIT_PENDING,
        LookupResult.MISS,
    ]

    manager.complete_store({k1, k2}, context)  # vLLM passes a set, no success flag
    assert lookups(manager, [k1, k2, k3], context) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]

    load_spec = manager.prepare_load([k1, k2], context)
    assert slots(load_spec) == [0, 1]
    assert manager.get_load_source(k1, context) is CacheHitSource.HOST
    if surface.MANAGER_HAS_TOUCH:  # vLLM 0.33's interface: 0.34 removed touch
        getattr(manager, "touch")([k1, k2], context)  # by name: absent from 0.34's manager type
    manager.complete_load({k1, k2}, context)
    manager.on_request_finished(context)
    assert lookups(manager, [k1], context) == [LookupResult.HIT]


def test_the_adapter_offers_touch_only_where_vllms_manager_interface_has_it() -> None:
    # vLLM 0.34 removed touch from the manager, the tiers and CachePolicy; its connector never called it.
    assert hasattr(make_manager(), "touch") is surface.MANAGER_HAS_TOUCH


def test_events_report_stores_and_evictions_in_vllm_types() -> None:
    manager = make_manager(num_slots=2)
    context = ReqContext(req_id="r1")
    k1, k2, k3 = to_keys([1, 2, 3])
    manager.prepare_store([k1, k2], context)
    manager.complete_store({k1, k2}, context)
    stored_events = list(manager.take_events())
    assert len(stored_events) == 1
    assert (set(stored_events[0].keys), stored_events[0].medium, stored_events[0].removed) == (
        {k1, k2},
        Medium.CPU,
        False,
    )
    assert list(manager.take_events()) == []  # drained

    # The cache is full: storing k3 evicts one of the ready keys (which one
    # depends on the order of the completion set: both became ready together).
    output = manager.prepare_store([k3], context)
    assert output is not None and output.keys_to_store == [k3]
    (evicted,) = output.evicted_keys
    assert evicted in (k1, k2)
    assert slots(output.store_spec) == [[k1, k2].index(evicted)]
    assert list(manager.take_events()) == [OffloadingEvent(keys=[evicted], medium=Medium.CPU, removed=True)]
    assert lookups(manager, [evicted, k3], context) == [LookupResult.MISS, LookupResult.HIT_PENDING]


def test_without_kv_events_no_events_are_kept() -> None:
    manager = make_manager(enable_events=False)
    context = ReqContext(req_id="r1")
    (k1,) = to_keys([1])
    manager.prepare_store([k1], context)
    manager.complete_store([k1], context)
    assert list(manager.take_events()) == []


def test_a_store_that_cannot_make_room_returns_none_and_changes_nothing() -> None:
    manager = make_manager(num_slots=2)
    context = ReqContext(req_id="r1")
    k1, k2, k3 = to_keys([1, 2, 3])
    manager.prepare_store([k1, k2], context)
    manager.complete_store([k1, k2], context)
    manager.prepare_load([k1, k2], context)  # both pinned by loads in flight
    assert manager.prepare_store([k3], context) is None
    assert lookups(manager, [k1, k2, k3], context) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]


def test_already_offloaded_keys_are_not_stored_again() -> None:
    manager = make_manager()
    context = ReqContext(req_id="r1")
    k1, k2 = to_keys([1, 2])
    manager.prepare_store([k1], context)
    output = manager.prepare_store([k1, k2], context)
    assert output is not None and output.keys_to_store == [k2] and slots(output.store_spec) == [1]
    nothing = manager.prepare_store([k1, k2], context)
    assert nothing is not None and (nothing.keys_to_store, slots(nothing.store_spec)) == ([], [])


def test_a_failed_store_frees_its_slot() -> None:
    manager = make_manager(num_slots=1)
    context = ReqContext(req_id="r1")
    k1, k2 = to_keys([1, 2])
    manager.prepare_store([k1], context)
    manager.complete_store([k1], context, success=False)
    assert lookups(manager, [k1], context) == [LookupResult.MISS]
    output = manager.prepare_store([k2], context)
    assert output is not None and slots(output.store_spec) == [0]


def test_loading_a_key_that_is_not_ready_raises_before_changing_anything() -> None:
    manager = make_manager()
    context = ReqContext(req_id="r1")
    k1, k2 = to_keys([1, 2])
    manager.prepare_store([k1], context)
    with pytest.raises(ValueError):
        manager.prepare_load([k1], context)
    with pytest.raises(ValueError):
        manager.prepare_load([k2], context)


def test_with_a_store_threshold_a_chunk_is_stored_on_its_second_offer() -> None:
    manager = make_manager(store_threshold=2)
    keys = to_keys([1, 2, 3])
    for context, stored in ((ReqContext(req_id="r1"), []), (ReqContext(req_id="r2"), keys)):
        # The connector looks up only until the first miss: just keys[0] here.
        assert lookups(manager, keys[:1], context) == [LookupResult.MISS]
        output = manager.prepare_store(keys, context)
        assert output is not None and output.keys_to_store == stored  # offered once: not worth a copy yet


def filtered_manager(num_slots: int, store_threshold: int) -> OffloadingManager:
    """The adapter over kvtriton's manager and the reuse filter that counts as the installed vLLM counts."""
    from kvtriton.integrations.vllm._manager import VLLMOffloadingManager, reuse_filter
    from kvtriton.manager import CPUOffloadingManager

    cpu = CPUOffloadingManager(num_slots)
    return VLLMOffloadingManager(reuse_filter(cpu, store_threshold, 64_000), cpu, summary_interval_s=0)


def offers_of_one_request(manager: OffloadingManager, store_threshold: int) -> tuple[list[OffloadKey], float]:
    """vLLM 0.34's test_store_threshold_counts_a_key_once_per_request: other requests offer ``warm`` until one
    more offer admits it; one request offers ``warm`` and ``cold``, then is preempted and offers them again as
    often as the threshold would need. What its last offer stores, and the stores skipped over its offers."""
    warm, cold = to_keys([1, 2])
    with manager.lock:
        for index in range(store_threshold - 1):
            manager.prepare_store([warm], ReqContext(req_id=f"warm-up-{index}"))
    manager.get_stats()  # drops the warm-up's skips
    context = ReqContext(req_id="req")
    with manager.lock:
        output = manager.prepare_store([warm, cold], context)
        assert output is not None and output.keys_to_store == [warm]
        manager.complete_store([warm], context)
        for _ in range(store_threshold - 1):
            output = manager.prepare_store([warm, cold], context)
            assert output is not None
    stats = manager.get_stats()
    assert stats is not None
    return output.keys_to_store, stats.reduce()[CPUOffloadingMetrics.STORES_SKIPPED]


@pytest.mark.skipif(
    not surface.STORE_OFFERS_COUNT_ONCE_PER_REQUEST, reason="STORE_OFFERS_COUNT_ONCE_PER_REQUEST: vLLM 0.34's rule"
)
@pytest.mark.parametrize("store_threshold", [2, 3])
def test_on_vllm_0_34_a_key_counts_once_per_request_as_in_vllms_cpu_manager(store_threshold: int) -> None:
    vllms = VLLMCPUOffloadingManager(num_chunks=4, cache_policy="lru", store_threshold=store_threshold)
    ours = filtered_manager(4, store_threshold)
    # The re-offers neither admit cold (only this request offered it) nor count its skip again.
    assert offers_of_one_request(ours, store_threshold) == offers_of_one_request(vllms, store_threshold) == ([], 1)


@pytest.mark.skipif(
    surface.STORE_OFFERS_COUNT_ONCE_PER_REQUEST, reason="not STORE_OFFERS_COUNT_ONCE_PER_REQUEST: vLLM 0.33's rule"
)
@pytest.mark.parametrize("store_threshold", [2, 3])
def test_on_vllm_0_33_every_offer_counts_as_in_vllms_cpu_manager(store_threshold: int) -> None:
    vllms = VLLMCPUOffloadingManager(num_chunks=4, cache_policy="lru", store_threshold=store_threshold)
    ours = filtered_manager(4, store_threshold)
    cold = to_keys([2])
    # The re-offers count: cold is admitted by its request's own repeated offers.
    expected = (cold, store_threshold - 1)
    assert offers_of_one_request(ours, store_threshold) == offers_of_one_request(vllms, store_threshold) == expected


def test_the_reuse_filter_counts_offers_as_the_installed_vllm_does() -> None:
    from kvtriton.integrations.vllm._manager import STORE_OFFER_SIGNAL
    from kvtriton.manager import ReuseSignal

    expected = (
        ReuseSignal.STORE_OFFER_PER_REQUEST if surface.STORE_OFFERS_COUNT_ONCE_PER_REQUEST else ReuseSignal.STORE_OFFER
    )
    assert STORE_OFFER_SIGNAL is expected


def test_stats_report_slab_occupancy_under_vllms_gauge_names() -> None:
    manager = make_manager(num_slots=4)
    context = ReqContext(req_id="r1")
    k1, k2, k3 = to_keys([1, 2, 3])
    manager.prepare_store([k1, k2, k3], context)
    manager.complete_store([k1, k2], context)
    manager.prepare_load([k1], context)
    stats = manager.get_stats()
    assert stats is not None
    assert stats.reduce() == {
        "vllm:kv_offload_cpu_cache_usage_perc": 0.5,  # k3 pending + k1 loading, of 4 slots (slots held by transfers)
        "vllm:kv_offload_cpu_cache_write_usage_perc": 0.25,
        "vllm:kv_offload_cpu_cache_read_usage_perc": 0.25,
        "vllm:kv_offload_cpu_cache_occupancy_perc": 0.75,  # k1, k2, k3 hold slots
        "vllm:kv_offload_cpu_allocation_size_count": 1,  # one prepare_store asked for slots ...
        "vllm:kv_offload_cpu_allocation_size_sum": 3,  # ... three of them
    }
    (info,) = manager.config_info()
    assert info["cpu_num_chunks"] == 4 and info["cpu_blocks_per_chunk"] == 1


def test_reset_cache_forgets_every_key() -> None:
    manager = make_manager()
    context = ReqContext(req_id="r1")
    k1, k2 = to_keys([1, 2])
    manager.prepare_store([k1, k2], context)
    manager.complete_store([k1], context)
    manager.reset_cache()
    assert lookups(manager, [k1, k2], context) == [LookupResult.MISS, LookupResult.MISS]
    output = manager.prepare_store([k2], context)
    assert output is not None and slots(output.store_spec) == [0]
    manager.shutdown()


SCENARIOS = ["load", "offer", "reload_own"]


def evicted_after_reuse(manager: OffloadingManager, scenario: str) -> list[OffloadKey]:
    """Store k1, k2, k3 (3 slots) in order, reuse k1 as ``scenario`` says, then store k4: what is evicted.

    ``load``: another request loads k1 (lookup, prepare_load, complete_load).
    ``offer``: another request offers k1 to prepare_store again (the GPU prefix
    cache still held it). ``reload_own``: k1's writer loads it back (after a
    preemption). vLLM 0.33's connector never calls touch() in any of them.
    """
    k1, k2, k3, k4 = to_keys([1, 2, 3, 4])
    writer = ReqContext(req_id="writer")
    with manager.lock:
        manager.on_new_request(writer)
        assert manager.prepare_store([k1], writer) is not None
        manager.complete_store({k1}, writer)
        for index, key in enumerate([k2, k3]):
            context = ReqContext(req_id=f"other{index}")
            manager.on_new_request(context)
            assert manager.prepare_store([key], context) is not None
            manager.complete_store({key}, context)
            manager.on_request_finished(context)
        reader = writer if scenario == "reload_own" else ReqContext(req_id="reader")
        if reader is not writer:
            manager.on_new_request(reader)
        if scenario == "offer":
            again = manager.prepare_store([k1], reader)
            assert again is not None and again.keys_to_store == []
        else:
            assert manager.lookup(k1, reader) is LookupResult.HIT
            manager.prepare_load([k1], reader)
            manager.complete_load({k1}, reader)
        manager.on_request_finished(reader)
        if reader is not writer:
            manager.on_request_finished(writer)
        output = manager.prepare_store([k4], ReqContext(req_id="new"))
    assert output is not None
    return output.evicted_keys


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("policy", SHARED_POLICIES)
def test_a_reused_chunk_outlives_older_unused_ones_as_in_vllms_cpu_manager(policy: str, scenario: str) -> None:
    ours = evicted_after_reuse(make_manager(num_slots=3, eviction_policy=policy), scenario)
    vllms = evicted_after_reuse(VLLMCPUOffloadingManager(num_chunks=3, cache_policy=policy), scenario)
    assert ours == vllms == to_keys([2])


def full_attention_group() -> object:
    """What the connector hands vLLM's events tracker for a full-attention group of one-block chunks of 16 tokens."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventGroupSpec

    return SimpleNamespace(
        hashes_per_chunk=1,
        tokens_per_chunk=16,
        tokens_per_block=16,
        sliding_window_size_in_chunks=None,
        group_idx=0,
        kv_cache_spec=None,  # no MambaSpec: not a recurrent group (vLLM 0.34 asks)
        kv_event_group_spec=OffloadingEventGroupSpec(None, None),
    )


def stored_events(manager: OffloadingManager, context: ReqContext) -> list[OffloadingEvent]:
    keys = to_keys([1, 2])
    with manager.lock:
        output = manager.prepare_store(keys, context)
        assert output is not None
        manager.complete_store(keys, context)
        return list(manager.take_events())


def test_a_stored_event_is_the_one_the_installed_vllms_cpu_manager_emits() -> None:
    """vLLM 0.34's names the request that stored the keys and expects their removal; 0.33's does neither."""
    ours, vllms = make_manager(num_slots=4), VLLMCPUOffloadingManager(num_chunks=4, enable_events=True)
    context = ReqContext(req_id="writer")
    (event,) = stored_events(ours, context)
    (expected,) = stored_events(vllms, context)
    fields = operator.attrgetter("keys", "medium", "removed", "metadata_only", "removal_expected")
    assert fields(event) == fields(expected)
    assert event.removal_expected is surface.EVENTS_CARRY_REQ_CONTEXT
    if surface.EVENTS_CARRY_REQ_CONTEXT:  # read by name: 0.34's field, absent from 0.33's type
        assert getattr(event, "req_context") is getattr(expected, "req_context") is context


@pytest.mark.skipif(not surface.EVENTS_CARRY_REQ_CONTEXT, reason="EVENTS_CARRY_REQ_CONTEXT: vLLM 0.34's events")
def test_on_vllm_0_34_the_events_tracker_describes_a_stored_chunk_from_its_request_and_fans_out_its_eviction() -> None:
    """No payload was recorded for the keys: vLLM 0.34's tracker builds it from the request the event names."""
    from types import SimpleNamespace
    from typing import Any

    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    manager = make_manager(num_slots=1)
    tracker = OffloadingEventsTracker(
        OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=True)
    )
    k1, k2 = to_keys([1, 2])
    context = ReqContext(req_id="writer")
    context.set_offload_key_position(k1, 16)
    request: Any = SimpleNamespace(
        block_hashes=[bytes(k1[:-4])],
        all_token_ids=list(range(100, 132)),
        lora_request=None,
        resumable=False,
        kv_transfer_params=None,
    )
    # By name: 0.34's tracker method, absent from 0.33's type (the test is skipped there).
    getattr(tracker, "on_new_request")(context, request, (full_attention_group(),))
    with manager.lock:
        manager.on_new_request(context)
        assert manager.prepare_store([k1], context) is not None
        manager.complete_store([k1], context)
        (stored,) = tracker.take_events(manager.take_events())
        assert isinstance(stored, BlockStored)
        assert stored.token_ids == list(range(100, 116)) and stored.block_size == 16
        output = manager.prepare_store([k2], ReqContext(req_id="other"))  # one slot: k1 is evicted
        assert output is not None and output.evicted_keys == [k1]
        (removed,) = tracker.take_events(manager.take_events())
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == stored.block_hashes


def test_a_failed_store_releases_the_payload_vllms_events_tracker_recorded() -> None:
    """vLLM's tracker keeps a payload per stored key until a removal names it; a failed store must name it too."""
    from types import SimpleNamespace
    from typing import Any, cast

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    manager = make_manager(num_slots=4)
    tracker = OffloadingEventsTracker(
        OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=True)
    )
    context = ReqContext(req_id="r1")
    manager.on_new_request(context)
    k1, k2 = to_keys([1, 2])
    block_hashes = [bytes(key[:-4]) for key in (k1, k2)]
    # What _build_store_jobs hands the tracker for a full-attention group of one-block chunks.
    req: Any = SimpleNamespace(block_hashes=block_hashes, all_token_ids=list(range(32)), lora_request=None)
    group: Any = full_attention_group()
    with manager.lock:
        output = manager.prepare_store([k1, k2], context)
        assert output is not None
        for chunk_idx, key in enumerate(output.keys_to_store):
            tracker.record_store(req, group, chunk_idx, key)
        payloads = cast("dict[object, object]", tracker._pending_event_metadata)  # pyright: ignore[reportPrivateUsage] -- the leak under test lives in this dict; the tracker exposes no count
        assert len(payloads) == 2
        manager.complete_store([k1, k2], context, success=False)
        published = list(tracker.take_events(manager.take_events()))
    assert published == []  # nothing was ever announced, so nothing is removed publicly
    assert payloads == {}


def allocation_sizes(stats: object) -> object:
    """The allocation-size observations in a stats payload (None when there are none)."""
    assert isinstance(stats, OffloadingConnectorStats)
    _, values = stats.metric_sections()
    return values.get(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, {}).get(())


def test_the_allocation_size_histogram_observes_each_store_that_asks_for_slots_as_vllm() -> None:
    # vLLM 0.33 counts the slots a prepare_store asks for, before it tries: a refused store counts too.
    ours, vllms = make_manager(num_slots=2), VLLMCPUOffloadingManager(num_chunks=2, cache_policy="lru")
    for manager in (ours, vllms):
        context = ReqContext(req_id="r1")
        with manager.lock:
            manager.prepare_store(to_keys([1]), context)
            manager.prepare_store(to_keys([1]), context)  # nothing new: no observation
            assert manager.prepare_store(to_keys([2, 3, 4]), context) is None  # k1 pending: no room
        first, second = manager.get_stats(), manager.get_stats()
        assert allocation_sizes(first) == [1, 3]
        assert allocation_sizes(second) is None


def test_the_stores_skipped_counter_counts_stores_below_the_reuse_threshold_as_vllm() -> None:
    ours = make_manager(num_slots=4, store_threshold=2)
    vllms = VLLMCPUOffloadingManager(num_chunks=4, cache_policy="lru", store_threshold=2)
    for manager in (ours, vllms):
        context = ReqContext(req_id="r1")
        with manager.lock:
            output = manager.prepare_store(to_keys([1, 2, 3]), context)
            assert output is not None and output.keys_to_store == []
        stats = manager.get_stats()
        assert stats is not None and stats.reduce()[CPUOffloadingMetrics.STORES_SKIPPED] == 3
        stats = manager.get_stats()
        assert stats is not None and stats.reduce()[CPUOffloadingMetrics.STORES_SKIPPED] == 0
        with manager.lock:
            output = manager.prepare_store(to_keys([1, 2, 4]), ReqContext(req_id="r2"))  # k1, k2 offered twice now
            assert output is not None and output.keys_to_store == to_keys([1, 2])
        stats = manager.get_stats()
        assert stats is not None and stats.reduce()[CPUOffloadingMetrics.STORES_SKIPPED] == 1


def test_metric_definitions_declare_what_get_stats_reports_with_vllms_names_and_types() -> None:
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingHistogramMetadata
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from kvtriton.integrations.vllm._manager import CPU_CACHE_OCCUPANCY_PERC, metric_definitions

    for extra in ({}, {"store_threshold": 2}):
        ours, vllms = metric_definitions(extra), CPUOffloadingSpec.build_metric_definitions(dict(extra))
        # vLLM's metrics, same names, types, labels and buckets; kvtriton adds its occupancy gauge.
        assert set(ours) == set(vllms) | {CPU_CACHE_OCCUPANCY_PERC}
        for name, theirs in vllms.items():
            assert type(ours[name]) is type(theirs) and ours[name].labelnames == theirs.labelnames, name
            if isinstance(theirs, OffloadingHistogramMetadata):
                histogram = ours[name]
                assert isinstance(histogram, OffloadingHistogramMetadata)
                assert histogram.buckets == theirs.buckets
        assert isinstance(ours[CPU_CACHE_OCCUPANCY_PERC], OffloadingGaugeMetadata)
    assert isinstance(
        metric_definitions({"store_threshold": 2})[CPUOffloadingMetrics.STORES_SKIPPED], OffloadingCounterMetadata
    )
    # Every name get_stats reports is declared (vLLM's Prometheus logger asserts it).
    manager = make_manager(num_slots=4, store_threshold=2)
    with manager.lock:
        # Two requests offer key 1: its second use on either release (0.34 counts a request's offers once).
        manager.prepare_store(to_keys([1]), ReqContext(req_id="r1"))
        manager.prepare_store(to_keys([1]), ReqContext(req_id="r2"))
    stats = manager.get_stats()
    assert isinstance(stats, OffloadingConnectorStats)
    types, _ = stats.metric_sections()
    reported = set(types)
    assert reported <= set(metric_definitions({"store_threshold": 2}))
    assert CPUOffloadingMetrics.CPU_ALLOCATION_SIZE in reported and CPUOffloadingMetrics.STORES_SKIPPED in reported


def test_the_cache_usage_gauge_documents_that_it_counts_slots_held_by_transfers() -> None:
    from kvtriton.integrations.vllm._manager import CPU_CACHE_OCCUPANCY_PERC, metric_definitions

    documentation = metric_definitions()[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC].documentation
    assert "held by transfers" in documentation and CPU_CACHE_OCCUPANCY_PERC in documentation


def test_a_summary_line_is_logged_after_each_interval_of_activity(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging

    import kvtriton.integrations.vllm._manager as vllm_manager

    now = [1000.0]
    monkeypatch.setattr(vllm_manager.time, "monotonic", lambda: now[0])
    cpu = kvtriton.CPUOffloadingManager(4)
    adapter = vllm_manager.VLLMOffloadingManager(cpu, cpu, summary_interval_s=60)
    caplog.set_level(logging.INFO, logger="kvtriton.integrations.vllm._manager")
    context = ReqContext(req_id="r1")
    k1, k2 = to_keys([1, 2])
    adapter.lookup(k1, context)
    adapter.prepare_store([k1, k2], context)
    adapter.complete_store([k1, k2], context)
    adapter.on_request_finished(context)
    assert not [r for r in caplog.records if "kvtriton summary:" in r.getMessage()]  # under a minute: nothing yet
    now[0] += 61
    reader = ReqContext(req_id="r2")
    assert adapter.lookup(k1, reader) is LookupResult.HIT
    adapter.prepare_load([k1], reader)
    adapter.complete_load([k1], reader)
    adapter.on_request_finished(reader)
    (line,) = [r.getMessage() for r in caplog.records if "kvtriton summary:" in r.getMessage()]
    assert line.startswith("kvtriton summary: last 61 s: 2 lookups, 1 hits (50.0%); loaded 1 chunks")
    assert "stored 2 chunks" in line and "evicted 0" in line and "occupancy 50.0% of 4 slots" in line


@pytest.mark.parametrize("interval", [-1.0, "60"])
def test_a_bad_summary_interval_is_refused(interval: object) -> None:
    from kvtriton.integrations.vllm._manager import VLLMOffloadingManager

    cpu = kvtriton.CPUOffloadingManager(4)
    with pytest.raises((TypeError, ValueError), match="summary_interval_s"):
        VLLMOffloadingManager(cpu, cpu, summary_interval_s=interval)  # pyright: ignore[reportArgumentType] -- the wrong value is the point


@pytest.mark.parametrize(
    ("bytes_per_chunk", "loaded", "stored"),
    [(288 << 10, "288.00 KiB", "576.00 KiB"), (3 << 29, "1.50 GiB", "3.00 GiB"), (100, "100 B", "200 B")],
)
def test_the_summary_line_gives_bytes_in_the_unit_that_fits_them(
    bytes_per_chunk: int, loaded: str, stored: str
) -> None:
    from kvtriton.integrations.vllm._manager import summary_line
    from kvtriton.manager import ManagerStats

    def snapshot(loads: int, stores: int) -> ManagerStats:
        return ManagerStats(
            capacity=4, used=2, pending=0, loading=0, evictable=2, lookups=0, hits=0, stores=stores, loads=loads
        )

    line = summary_line(snapshot(0, 0), snapshot(1, 2), 61, bytes_per_chunk)
    assert f"loaded 1 chunks ({loaded}), stored 2 chunks ({stored})" in line


def test_the_summary_line_in_docs_operations_is_the_one_logged() -> None:
    from pathlib import Path

    from kvtriton.integrations.vllm._manager import summary_line
    from kvtriton.manager import ManagerStats

    page = (Path(__file__).resolve().parents[3] / "docs" / "operations.md").read_text(encoding="utf-8")
    (documented,) = [line for line in page.splitlines() if line.startswith("kvtriton summary:")]
    before = ManagerStats(capacity=4, used=0, pending=0, loading=0, evictable=0, lookups=0, hits=0)
    after = ManagerStats(capacity=4, used=2, pending=0, loading=0, evictable=2, lookups=2, hits=1, stores=2, loads=1)
    assert summary_line(before, after, 61, 288 << 10) == documented
