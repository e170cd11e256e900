"""The second tier behind the host tier: cascade, promotion, the fs tier's fill, the Mooncake pool's eviction, compressed
bytes, the cheapest point across tiers and servers sharing a tier, each on a trace small enough to count by hand.

Every trace here runs one request at a time (``--sequential``), without the
engine's prefix cache, a store done the step after the one that prepared it
(``store_steps=1``), so each step is written out in the test that needs it.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvtriton._keys import make_offload_key
from kvtriton.sim._geometry import GIB, PRESETS, KVDtype, ModelGeometry
from kvtriton.sim._planner import VllmOrder
from kvtriton.sim._replay import prepare
from kvtriton.sim._secondary_tier import FsTier, MooncakePool, TierCounts
from kvtriton.sim._tier_models import TierSpec, parse_tier
from kvtriton.sim._tiered_planner import TieredReport, recommend_tiered, replay_tiered
from kvtriton.sim._vllm_server import ServerModel, StalledRequest, predict
from kvtriton.sim._workloads import Request, generate

BLOCK = 16
ONE_AT_A_TIME = ServerModel(sequential=True, store_steps=1)
GEOMETRY = ModelGeometry("tiny", num_layers=2, num_kv_heads=1, head_dim=16, dtype=KVDtype.BFLOAT16, block_size=BLOCK)
"""2048 bytes per block (2 layers x K and V x 16 x 2 bytes x 16 tokens)."""


def request(name: str, *blocks: int) -> Request:
    """A prompt of ``blocks`` full blocks (hashes named by number) and 8 tokens more, so every block can be loaded."""
    return Request(name, tuple(block.to_bytes(16, "big") for block in blocks), len(blocks) * BLOCK + 8)


def counts_of(requests: list[Request], tier: FsTier | MooncakePool, *, slots: int = 4) -> tuple[TierCounts, int]:
    """The tier counts and external hit tokens of one engine over ``requests`` (the tier kept for the next call)."""
    stats = predict(requests, slots=slots, block_size=BLOCK, model=ONE_AT_A_TIME, tier=tier)
    assert stats.tiers is not None
    return stats.tiers, stats.external_hit_tokens


def test_a_completed_host_store_cascades_to_the_tier() -> None:
    # Step 1: blocks 1 and 2 miss the host; the fs check has not run (RETRY): deferred. Step 2: block 1 is not on
    # disk (one fs query, its miss ends the scan), computed, stored; step 3 the store completes and cascades.
    disk = FsTier()
    counts, hits = counts_of([request("a", 1, 2)], disk)
    assert (counts.host_chunk_queries, counts.host_chunk_hits) == (2, 0)
    assert (counts.tier_chunk_queries, counts.tier_chunk_hits) == (1, 0)
    assert (counts.cascaded_chunks, counts.promotions, disk.chunks, hits) == (2, 0, 2, 0)


def test_a_host_miss_the_tier_holds_is_promoted_and_the_request_waits_two_steps() -> None:
    disk = FsTier()
    counts_of([request("a", 1, 2)], disk)
    # The restart: an empty host tier in front of the same disk. Step 1: RETRY for both blocks (deferral 1);
    # step 2: both on disk, each takes a host slot and answers HIT_PENDING (deferral 2); step 3: the promotion
    # has landed, both hit the host and load.
    stats = predict([request("a", 1, 2)], slots=4, block_size=BLOCK, model=ONE_AT_A_TIME, tier=disk)
    assert stats.tiers is not None
    assert (stats.outcomes[0].deferrals, stats.outcomes[0].admitted_step) == (2, 3)
    assert (stats.external_hit_tokens, stats.external_query_tokens) == (32, 40)
    counts = stats.tiers
    # A promoted chunk is a host miss and a tier hit, as vLLM's chunk metrics count it.
    assert (counts.host_chunk_queries, counts.host_chunk_hits) == (2, 0)
    assert (counts.tier_chunk_queries, counts.tier_chunk_hits) == (2, 2)
    assert (counts.promotions, counts.promotion_jobs, counts.cascaded_chunks) == (2, 1, 0)


def test_a_second_request_hits_what_the_first_promoted_in_the_host_tier() -> None:
    disk = FsTier()
    counts_of([request("a", 1, 2)], disk)
    counts, hits = counts_of([request("a", 1, 2), request("b", 1, 2, 3)], disk, slots=8)
    # b: blocks 1 and 2 are in the host tier now (host hits), block 3 misses both tiers.
    assert (counts.host_chunk_queries, counts.host_chunk_hits) == (5, 2)
    assert (counts.tier_chunk_queries, counts.tier_chunk_hits) == (3, 2)
    assert (counts.promotions, hits) == (2, 64)


def test_the_fs_tier_never_evicts_and_reports_the_disk_it_filled() -> None:
    requests = prepare([request(f"r{index}", 10 * index + 1, 10 * index + 2, 10 * index + 3) for index in range(5)])
    # A 2048-byte block is a 4096-byte chunk in the tiered spec's region (its seal's room, padded to 4 KiB).
    report = replay_tiered([requests], GEOMETRY, 6 * 4096, TierSpec("fs"), "lru", VllmOrder(sequential=True)).report
    assert report.counts is not None
    # 15 distinct blocks, each written once; the 6-block host tier evicted 9 of them, the disk none.
    assert (report.counts.cascaded_chunks, report.counts.tier_chunks, report.counts.tier_evictions) == (15, 15, 0)
    assert report.host_evictions == 9
    assert report.tier_fill_bytes == report.tier_write_bytes == 15 * 4096
    assert report.tier_size_bytes == 15 * 4096  # fs is bought by what it fills


def test_the_mooncake_pool_evicts_the_least_recently_leased_tenth_past_its_watermark() -> None:
    pool = MooncakePool(10)
    keys = [make_offload_key(index.to_bytes(16, "big")) for index in range(1, 11)]
    for key in keys[:9]:
        assert pool.put(key)
    assert (pool.chunks, pool.evictions) == (9, 0)  # 90% full is not past the 90% watermark
    assert pool.contains(keys[0])  # an existence check renews object 1's lease
    assert pool.put(keys[9])
    # 100% full: the master evicts max(5%, 100% - 90% + 5%) = 15% of 10 objects, rounded up: 2, objects 2 and 3.
    assert (pool.chunks, pool.evictions) == (8, 2)
    assert [pool.contains(key) for key in keys[:4]] == [True, False, False, True]
    assert pool.put(keys[3])  # present: kept as it was


def test_compression_shrinks_both_tiers_bytes_and_mooncake_adds_its_seal() -> None:
    compressed = GEOMETRY.with_compression("fp8-e4m3")
    assert compressed.stored_bytes_per_block == 1280  # fp8 codes plus one fp32 scale per 16 elements
    # At this tiny size the region's 4 KiB padding hides the shrink; at a real model's it shows.
    assert compressed.tiered_chunk_bytes == GEOMETRY.tiered_chunk_bytes == 4096
    llama = PRESETS["llama-3-8b"]
    assert llama.with_compression("fp8-e4m3").tiered_chunk_bytes < 0.53 * llama.tiered_chunk_bytes
    pool = TierSpec("mooncake", 41_600)
    assert pool.object_bytes(compressed) == 4096 + 64  # the region's chunk, with its seal, plus Mooncake's seal
    built = pool.build(compressed)
    assert isinstance(built, MooncakePool) and built.capacity_objects == 10  # 41600 // 4160
    assert TierSpec("mooncake", 41_600).build(GEOMETRY).chunks == 0
    requests = prepare([request("a", 1, 2, 3)])
    report = replay_tiered([requests], compressed, 4 * 4096, pool, "lru", VllmOrder(sequential=True)).report
    assert report.counts is not None and report.counts.cascaded_chunks == 3
    assert (report.bytes_per_chunk, report.tier_write_bytes, report.tier_fill_bytes) == (4096, 3 * 4096, 3 * 4160)
    assert report.host_store_bytes == 3 * 1280  # the GPU copies move the rows, not the padding


def report(host_gib: float, pool_gib: float, hits: int) -> TieredReport:
    """A point with a pool of ``pool_gib`` whose combined rate is ``hits`` %."""
    return TieredReport(
        policy="lru", servers=1, host_bytes=int(host_gib * GIB), host_blocks=1, tier=TierSpec("mooncake", int(pool_gib * GIB)),
        stalled=False, external_query_tokens=100, external_hit_tokens=hits, counts=None, bytes_per_chunk=2048,
        tier_object_bytes=2112, host_evictions=0, host_load_bytes=0, host_store_bytes=0,
    )  # fmt: skip


def test_the_target_picks_the_cheapest_point_with_host_memory_priced_above_the_pool() -> None:
    points = [report(4, 8, 60), report(1, 32, 62), report(1, 8, 40)]
    # At 10x: 4 GiB host + 8 GiB pool costs 48 tier-GiB, 1 + 32 costs 42; 1 + 8 misses the target.
    found = recommend_tiered(points, 0.55, 10.0, GEOMETRY)
    assert found.point is points[1]
    assert found.extra_config == {
        "spec_name": "KVTritonTieringOffloadingSpec",
        "spec_module_path": "kvtriton.integrations.vllm",
        "cpu_bytes_to_use": GIB,
        "eviction_policy": "lru",
        "secondary_tiers": [
            {
                "type": "MooncakeStoreTier",
                "module_path": "kvtriton.integrations.mooncake",
                "master_server_address": "<mooncake_master host:port>",
            }
        ],
    }
    # At 2x host memory is cheap: 4 + 8 costs 16, 1 + 32 costs 34.
    assert recommend_tiered(points, 0.55, 2.0, GEOMETRY).point is points[0]
    unreachable = recommend_tiered(points, 0.7, 10.0, GEOMETRY)
    assert (unreachable.point, unreachable.best, unreachable.extra_config) == (None, points[1], None)


def test_servers_share_one_tier_so_one_servers_cascade_serves_another() -> None:
    # Server 0 computes a (blocks 1, 2) in step 2; its store completes in step 3 and cascades, landing on disk in
    # step 4's window. Server 1 first serves two one-block requests (steps 1-2 and 3-4); b arrives in step 5, its
    # existence checks run then and find server 0's chunks: promoted in step 6, loaded in step 7.
    streams = [prepare([request("a", 1, 2)]), prepare([request("c", 7), request("d", 8), request("b", 1, 2)])]
    shared = replay_tiered(streams, GEOMETRY, 4 * 2048, TierSpec("fs"), "lru", VllmOrder(sequential=True)).report
    assert shared.counts is not None
    assert (shared.counts.tier_chunk_hits, shared.counts.promotions) == (2, 2)
    assert (shared.external_hit_tokens, shared.counts.tier_chunks) == (32, 4)
    # One filler fewer and b asks before the cascade lands: the disk has nothing for it yet.
    early = [streams[0], prepare([request("c", 7), request("b", 1, 2)])]
    missed = replay_tiered(early, GEOMETRY, 4 * 2048, TierSpec("fs"), "lru", VllmOrder(sequential=True)).report
    assert missed.counts is not None
    assert (missed.counts.tier_chunk_hits, missed.external_hit_tokens) == (0, 0)


def test_a_prompt_longer_than_the_host_tier_stalls_as_vllm_would() -> None:
    disk = FsTier()
    counts_of([request("a", 1, 2, 3)], disk, slots=8)
    # Promoting block 3 into a 2-slot host tier evicts block 1, promoted the step before, and so on for ever.
    with pytest.raises(StalledRequest, match="request 'a' was deferred 1000 steps"):
        predict([request("a", 1, 2, 3)], slots=2, block_size=BLOCK, model=ONE_AT_A_TIME, tier=disk)
    stalled = replay_tiered(
        [prepare([request("a", 1, 2, 3)])], GEOMETRY, 2 * 2048, TierSpec("fs"), "lru", VllmOrder(sequential=True)
    ).report
    assert not stalled.stalled  # a fresh disk has nothing to promote: the prompt is computed and stored


def test_a_request_whose_own_promotions_evict_what_it_found_stalls_and_says_so() -> None:
    # Found with `kvtriton simulate --workload chat --requests 100 --tier mooncake:2GiB --capacities 0.25`: the
    # request's 90 chunks fit the host tier's 127, yet it never runs. The host tier is full, a lookup does not renew
    # a chunk, and LRU ranks the chunks it found by when it was first seen, below those of requests that finished
    # since: each chunk it promotes evicts one it found, step after step (vLLM's own LRU rule).
    requests = prepare(generate("chat", seed=0, block_size=16, overrides={"requests": 100}))
    llama = PRESETS["llama-3-8b"]
    report = replay_tiered(
        [requests], llama, GIB // 4, TierSpec("mooncake", 2 * GIB), "lru", VllmOrder(arrivals=4)
    ).report
    assert report.stalled
    assert report.stall is not None
    assert (report.stall.req_id, report.stall.prompt_chunks, report.stall.host_chunks) == ("chat-38-turn-2", 90, 127)
    assert report.stall.fits and report.stall.own_evictions > 0
    roomier = replay_tiered(
        [requests], llama, GIB // 2, TierSpec("mooncake", 2 * GIB), "lru", VllmOrder(arrivals=4)
    ).report
    assert not roomier.stalled and roomier.stall is None


def test_a_tier_is_named_fs_or_mooncake_with_an_optional_size() -> None:
    assert parse_tier("fs") == TierSpec("fs")
    assert parse_tier("Mooncake:64GiB") == TierSpec("mooncake", 64 * GIB)
    assert parse_tier("mooncake") == TierSpec("mooncake")
    for bad, message in (
        ("fs:1G", "no capacity"),
        ("s3", "fs, mooncake or mooncake:SIZE"),
        ("mooncake:-1", "positive"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_tier(bad)
    assert dataclasses.replace(TierSpec("fs")).describe() == "fs"


# --------------------------------------------------------------------------
# Concurrent arrivals: every per-tier figure agrees with the point's own loads

SHARED_PROMPTS = [
    request(f"r{index}", *range(100 * (index % 3), 100 * (index % 3) + 3), 1000 + index) for index in range(24)
]
"""24 requests over 3 shared 3-block prefixes, each with a block of its own: later requests find the prefixes."""
ARRIVALS = {
    "one at a time": {"sequential": True},
    "concurrency 4": {"concurrency": 4},
    "rate 0.5 per step": {"request_rate": 0.5},
    "burst": {},
}


@pytest.mark.parametrize("arrivals", ARRIVALS)
@pytest.mark.parametrize("host_bytes", [4 * 2048 * 3, 64 * 2048 * 3])
@pytest.mark.parametrize("kind", ["fs", "mooncake"])
def test_each_tiers_column_is_consistent_with_the_points_loads(arrivals: str, host_bytes: int, kind: str) -> None:
    """What each tier served adds up to vLLM's combined rate and to the bytes the host tier loaded, in every mode."""
    order = VllmOrder(max_num_seqs=4, store_steps=1, **ARRIVALS[arrivals])  # pyright: ignore[reportArgumentType] -- the modes' keyword arguments
    tier = TierSpec(kind, None if kind == "fs" else 64 * GIB)
    report = replay_tiered([prepare(SHARED_PROMPTS)], GEOMETRY, host_bytes, tier, "lru", order).report
    counts = report.counts
    assert counts is not None and report.external_hit_tokens > 0
    loaded = counts.host_loaded_chunks + counts.tier_loaded_chunks
    assert loaded * BLOCK == report.external_hit_tokens
    assert report.host_load_bytes == loaded * GEOMETRY.stored_bytes_per_block
    assert report.host_served_rate + report.tier_served_rate == pytest.approx(report.external_hit_rate)
    assert counts.tier_loaded_chunks <= counts.promotions
    assert (report.host_served_rate > 0) == (counts.host_loaded_chunks > 0)
    assert (report.tier_served_rate > 0) == (counts.tier_loaded_chunks > 0)


def test_in_a_burst_vllms_first_lookup_counters_miss_what_the_host_tier_then_serves() -> None:
    """Every request of a burst looks its prefix up in step 1, before anything is stored: vLLM's chunk counters
    (first lookups) read 0 hits for both tiers, yet the host tier serves the shared prefixes once stored."""
    order = VllmOrder(max_num_seqs=4, store_steps=1)
    report = replay_tiered([prepare(SHARED_PROMPTS)], GEOMETRY, 64 * 2048 * 3, TierSpec("fs"), "lru", order).report
    assert report.counts is not None
    assert (report.counts.host_chunk_hits, report.counts.tier_chunk_hits) == (0, 0)
    assert report.counts.host_chunk_queries > 0
    assert report.host_served_rate > 0.5 and report.tier_served_rate == 0


def test_a_client_with_n_in_flight_sends_the_next_request_once_one_finished() -> None:
    """concurrency=N admits N at first and one more each step after a request finished; 1 is sequential."""
    prompts = [request(f"r{index}", 10 * index) for index in range(6)]
    steps = {
        n: [outcome.admitted_step for outcome in predict(prompts, slots=8, block_size=BLOCK, model=model).outcomes]
        for n, model in (
            (1, ServerModel(concurrency=1, store_steps=1)),
            (2, ServerModel(concurrency=2, store_steps=1)),
            ("sequential", ServerModel(sequential=True, store_steps=1)),
        )
    }
    assert steps[1] == steps["sequential"] == [1, 2, 3, 4, 5, 6]  # each answered in its step, the next sent after
    assert steps[2] == [1, 1, 2, 2, 3, 3]


def test_poisson_arrivals_are_seeded_and_average_the_rate() -> None:
    model = ServerModel(request_rate=0.25, arrival_seed=7)
    steps = model.arrival_steps(400)
    assert steps is not None and steps == ServerModel(request_rate=0.25, arrival_seed=7).arrival_steps(400)
    assert steps[0] == 1 and steps == sorted(steps)
    assert 400 / steps[-1] == pytest.approx(0.25, rel=0.15)
    assert steps != ServerModel(request_rate=0.25, arrival_seed=8).arrival_steps(400)
    with pytest.raises(ValueError, match="concurrency=2 and request_rate=0.5 are two arrival patterns"):
        ServerModel(concurrency=2, request_rate=0.5)
    with pytest.raises(ValueError, match="request_rate must be a finite number > 0"):
        ServerModel(request_rate=0.0)
