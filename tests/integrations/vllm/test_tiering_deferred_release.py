"""Deferred release on kvtriton's primary tier: a failed promotion whose tier may still write holds its chunks.

vLLM 0.34's orchestrator calls ``defer_write_release`` on its primary when a
secondary tier reports a failed promotion with ``JobResult.deferred_release``
(its I/O may still write into the chunks), and ``release_deferred_write``
once the tier sets that event; it reads ``num_deferred_release_chunks`` and
reports the ``DEFERRED_RELEASE_*`` metrics. The keys miss at once; the chunks
stay out of the free pool until released, so a chunk stored meanwhile is
never overwritten by the late writer. The primary's own methods are tested on
either release; the orchestrator drives them only on vLLM 0.34.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

from tiering_fixtures.configs import key, primary_of, tiering
from tiering_fixtures.deferring_tier import DeferringTier
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, OffloadKey, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VLLMCPULoadStoreSpec
from vllm.v1.kv_offload.tiering import base as tiering_base
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvtriton.integrations.vllm import KVTritonTieringOffloadingSpec
from kvtriton.integrations.vllm import _surface as surface
from kvtriton.integrations.vllm._sealed_tiering import tier_label

CHUNK = 4096  # 2048-byte blocks, one rank and a seal, padded to 4096 bytes
STEP_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
DEFERRING_TIER: dict[str, object] = {"type": "DeferringTier", "module_path": "tiering_fixtures.deferring_tier"}

only_on_0_34 = pytest.mark.skipif(
    not surface.PRIMARY_DEFERS_WRITE_RELEASE,
    reason="PRIMARY_DEFERS_WRITE_RELEASE: only vLLM 0.34's orchestrator defers a failed promotion's release",
)


def deferring_tiering(
    managers: list[OffloadingManager], chunks: int, tiers: list[dict[str, object]], *, enable_events: bool = False
) -> TieringOffloadingManager:
    """kvtriton's tiered manager with ``chunks`` primary chunks in front of ``tiers``."""
    extra: dict[str, object] = {"cpu_bytes_to_use": chunks * CHUNK, "secondary_tiers": tiers}
    return tiering(managers, extra, enable_events=enable_events)


def chunk_ids(spec: object) -> list[int]:
    assert isinstance(spec, VLLMCPULoadStoreSpec)
    return spec.chunk_ids.tolist()


def test_a_deferred_write_misses_at_once_and_holds_its_chunks_until_released(
    managers: list[OffloadingManager],
) -> None:
    primary = primary_of(deferring_tiering(managers, 4, []))
    context = ReqContext(req_id="r")
    output = primary.prepare_write([key(1), key(2), key(3)], context)  # all three pending
    assert output is not None and chunk_ids(output.store_spec) == [0, 1, 2]
    held = primary.defer_write_release([key(2), key(1)])
    assert held == [1, 0]
    assert [primary.lookup(k, context) for k in (key(1), key(2))] == [LookupResult.MISS, LookupResult.MISS]
    assert primary.num_deferred_release_chunks == 2
    assert primary.cpu.stats().free == 1
    # Stored again meanwhile, a key takes a chunk the late writer cannot touch.
    again = primary.prepare_write([key(1)], context)
    assert again is not None and chunk_ids(again.store_spec) == [3]
    assert primary.prepare_write([key(4)], context) is None  # the held chunks are not free
    primary.release_deferred_write(held)
    assert primary.num_deferred_release_chunks == 0
    after = primary.prepare_write([key(4)], context)
    assert after is not None and chunk_ids(after.store_spec) in ([0], [1])


def test_a_deferred_write_reports_the_keys_dropped_and_counts_its_chunks_as_write_pending(
    managers: list[OffloadingManager],
) -> None:
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

    primary = primary_of(deferring_tiering(managers, 4, [], enable_events=True))
    context = ReqContext(req_id="r")
    primary.prepare_write([key(1), key(2)], context)
    primary.defer_write_release([key(1), key(2)])
    (event,) = primary.take_events()
    assert (event.keys, event.removed, event.metadata_only) == ([key(1), key(2)], True, True)
    stats = primary.get_stats()
    assert stats is not None
    assert stats.reduce()[CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC] == 0.5  # as vLLM's primary counts them


def test_deferring_a_key_that_is_no_pending_write_fails_the_orchestrators_assertion(
    managers: list[OffloadingManager],
) -> None:
    primary = primary_of(deferring_tiering(managers, 4, []))
    context = ReqContext(req_id="r")
    primary.prepare_write([key(5)], context)
    primary.complete_write([key(5)], context)
    for keys in ([key(5)], [key(6)]):
        with pytest.raises(AssertionError, match="is not a pending write"):
            primary.defer_write_release(keys)
    assert primary.num_deferred_release_chunks == 0


def test_reset_cache_is_refused_while_chunks_are_held(managers: list[OffloadingManager]) -> None:
    primary = primary_of(deferring_tiering(managers, 4, []))
    context = ReqContext(req_id="r")
    primary.prepare_write([key(1)], context)
    held = primary.defer_write_release([key(1)])
    with pytest.raises(RuntimeError, match="still held"):
        primary.reset_cache()
    primary.release_deferred_write(held)
    primary.reset_cache()


def promote_into_a_deferred_failure(manager: TieringOffloadingManager, keys: list[OffloadKey]) -> DeferringTier:
    """Ask for ``keys``, which only the deferring tier holds: each promotion fails with a deferred release."""
    (tier,) = manager.secondary_tiers
    assert isinstance(tier, DeferringTier)
    tier.keys.update(keys)
    context = ReqContext(req_id="r")
    with manager.lock:
        manager.on_new_request(context)
        assert [manager.lookup(k, context) for k in keys] == [LookupResult.HIT_PENDING] * len(keys)
        manager.on_schedule_end(STEP_END)  # submits the promotions
        manager.on_schedule_end(STEP_END)  # processes their failure
    return tier


@only_on_0_34
def test_on_vllm_0_34_a_promotion_failed_with_a_deferred_release_holds_the_chunks_until_the_tier_is_done(
    managers: list[OffloadingManager],
) -> None:
    manager = deferring_tiering(managers, 4, [DEFERRING_TIER])
    primary = primary_of(manager)
    free_before = primary.cpu.stats().free
    tier = promote_into_a_deferred_failure(manager, [key(1), key(2)])
    context = ReqContext(req_id="r")
    assert [primary.lookup(k, context) for k in (key(1), key(2))] == [LookupResult.MISS, LookupResult.MISS]
    assert primary.num_deferred_release_chunks == 2 and primary.cpu.stats().free == free_before - 2
    with manager.lock:
        assert manager.has_pending_work()
        manager.on_schedule_end(STEP_END)
    assert primary.num_deferred_release_chunks == 2  # still held: the tier has not said it is done
    metrics = getattr(tiering_base.TieringOffloadingMetrics, "DEFERRED_RELEASE_CHUNKS")  # by name: 0.34's
    hold = getattr(tiering_base.TieringOffloadingMetrics, "DEFERRED_RELEASE_HOLD")
    label = (tier_label(0, tier),)  # vLLM's label values, as its stats name them
    stats = manager.get_stats()
    assert stats is not None and stats.reduce()[f"{metrics}:{label}"] == 2

    for release in tier.releases:
        release.set()
    with manager.lock:
        manager.on_schedule_end(STEP_END)
    assert primary.num_deferred_release_chunks == 0 and primary.cpu.stats().free == free_before
    stats = manager.get_stats()
    assert stats is not None
    reduced = stats.reduce()
    assert reduced[f"{metrics}:{label}"] == 0 and reduced[f"{hold}:{label}_count"] == 1


@only_on_0_34
def test_on_vllm_0_34_reset_cache_waits_for_the_tier_to_release_the_held_chunks(
    managers: list[OffloadingManager],
) -> None:
    manager = deferring_tiering(managers, 4, [DEFERRING_TIER])
    primary = primary_of(manager)
    promote_into_a_deferred_failure(manager, [key(1), key(2)])
    assert primary.num_deferred_release_chunks == 2
    with manager.lock:
        manager.reset_cache()  # the orchestrator drains the tier (which releases), then resets the primary
    assert primary.num_deferred_release_chunks == 0 and primary.cpu.stats().free == 4


@only_on_0_34
def test_on_vllm_0_34_the_tiered_spec_declares_the_deferred_release_metrics() -> None:
    definitions = KVTritonTieringOffloadingSpec.build_metric_definitions({"cpu_bytes_to_use": 1 << 20})
    names = {
        str(getattr(tiering_base.TieringOffloadingMetrics, name))
        for name in ("DEFERRED_RELEASE_CHUNKS", "DEFERRED_RELEASE_HOLD")
    }
    assert names <= set(definitions)
