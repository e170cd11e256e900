"""A fleet behind a router sharing one pool, rule by rule: the routers, the shared pool, the knee, and a fleet of one
engine against the single-engine model."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator

import pytest

from kvtriton._keys import OffloadKey
from kvtriton.sim._fleet import EngineReport, FleetPoint, fleet_point, fleet_sweep, pool_knees, recommend_fleet
from kvtriton.sim._geometry import GIB, PRESETS, KVDtype, ModelGeometry
from kvtriton.sim._planner import VllmOrder
from kvtriton.sim._replay import PreparedRequest, prepare
from kvtriton.sim._router import route, split_streams
from kvtriton.sim._tier_models import TierSpec
from kvtriton.sim._tiered_planner import TieredReport, collector_paused, replay_tiered
from kvtriton.sim._vllm_server import predict
from kvtriton.sim._workloads import Request, generate

BLOCK = 16
GEOMETRY = ModelGeometry("tiny", num_layers=2, num_kv_heads=1, head_dim=16, dtype=KVDtype.BFLOAT16, block_size=BLOCK)
"""2048 bytes per block; a tiered chunk of 4096 bytes, 4160 in a Mooncake pool with its seal."""
POOL_OBJECT = 4096 + 64


def request(name: str, *blocks: int) -> Request:
    """A prompt of ``blocks`` full blocks (hashes named by number) and 8 tokens more, so every block can be loaded."""
    return Request(name, tuple(block.to_bytes(16, "big") for block in blocks), len(blocks) * BLOCK + 8)


# -- the routers -------------------------------------------------------------------------------------------


def test_round_robin_sends_request_i_to_engine_i_mod_n() -> None:
    trace = prepare([request(f"r{i}", i + 1) for i in range(7)])
    assert route(trace, 3, "round-robin") == [0, 1, 2, 0, 1, 2, 0]
    streams = split_streams(trace, 3, route(trace, 3, "round-robin"))
    assert [[each.req_id for each in stream] for stream in streams] == [["r0", "r3", "r6"], ["r1", "r4"], ["r2", "r5"]]


def test_prefix_affinity_sends_a_shared_k_block_prefix_to_one_engine() -> None:
    # 12 prefixes of 3 blocks, each followed by 5 different tails: with K = 3 every tail of a prefix meets its
    # siblings on one engine, and the prefixes spread over the engines.
    trace = prepare(
        [request(f"p{p}-t{t}", 100 * p + 1, 100 * p + 2, 100 * p + 3, 10_000 + 10 * p + t) for p in range(12) for t in range(5)]
    )  # fmt: skip
    engines = route(trace, 4, "prefix-affinity", affinity_blocks=3)
    by_prefix = {p: {engines[5 * p + t] for t in range(5)} for p in range(12)}
    assert all(len(chosen) == 1 for chosen in by_prefix.values())
    assert len({engine for (engine,) in by_prefix.values()}) > 1
    # K = 4 reaches into the tails, which differ: the siblings no longer all meet.
    wider = route(trace, 4, "prefix-affinity", affinity_blocks=4)
    assert any(len({wider[5 * p + t] for t in range(5)}) > 1 for p in range(12))
    # The same trace routes the same way every time (the hash is not Python's salted one).
    assert route(trace, 4, "prefix-affinity", affinity_blocks=3) == engines


def test_prefix_affinity_hashes_what_a_short_prompt_has_and_a_blockless_one_by_its_id() -> None:
    short = prepare([request("a", 1, 2), request("b", 1, 2, 3, 4, 5)])
    # "a" has only 2 of K = 4 blocks: it hashes its whole 2-block prefix, which "b" shares only up to block 2.
    (engine_of_a,) = {
        route(short, 1000, "prefix-affinity")[0],
        route(short, 1000, "prefix-affinity", affinity_blocks=2)[0],
    }
    assert route(short, 1000, "prefix-affinity", affinity_blocks=2) == [engine_of_a, engine_of_a]
    blockless = [PreparedRequest("x", (), (), 3), PreparedRequest("y", (), (), 3)]
    assert route(blockless, 1000, "prefix-affinity") == route(list(reversed(blockless)), 1000, "prefix-affinity")[::-1]


def test_a_router_refuses_no_engines_and_an_unknown_name() -> None:
    trace = prepare([request("a", 1)])
    with pytest.raises(ValueError, match="engines must be >= 1, got 0"):
        route(trace, 0, "round-robin")
    with pytest.raises(ValueError, match="affinity_blocks must be >= 1, got 0"):
        route(trace, 2, "prefix-affinity", affinity_blocks=0)
    with pytest.raises(ValueError, match="router must be one of round-robin, prefix-affinity, got 'random'"):
        route(trace, 2, "random")  # pyright: ignore[reportArgumentType] -- the check for an untyped caller


# -- the shared pool -----------------------------------------------------------------------------------------


def test_a_prefix_engine_a_cascades_into_the_pool_is_a_pool_hit_for_engine_b() -> None:
    # Round robin: engine 0 serves a (blocks 1, 2), x and y; engine 1 serves c, d, then b (blocks 1, 2). Engine 0
    # stores a and cascades it to the pool by step 4; b arrives on engine 1 in step 5 and finds both chunks there.
    trace = prepare([request("a", 1, 2), request("c", 7), request("x", 9), request("d", 8), request("y", 10), request("b", 1, 2)])  # fmt: skip
    streams = split_streams(trace, 2, route(trace, 2, "round-robin"))
    pool = TierSpec("mooncake", 100 * POOL_OBJECT)
    point = fleet_point(streams, GEOMETRY, 4 * 2048, pool, "lru", VllmOrder(sequential=True), router="round-robin")
    first, second = point.engines
    assert (first.pool_hit_tokens, second.pool_hit_tokens) == (0, 2 * BLOCK)
    assert (first.promoted_chunks, second.promoted_chunks) == (0, 2)
    assert first.cascaded_chunks >= 2
    assert point.pool_hit_tokens == 2 * BLOCK
    # Engine 1's own host tier never held blocks 1 and 2: nothing of b is a host hit.
    assert second.host_hit_tokens == 0
    # Without the earlier requests on engine 1, b asks before the cascade lands and computes its prompt.
    early = split_streams(trace[:2] + trace[5:], 2, [0, 1, 1])
    missed = fleet_point(early, GEOMETRY, 4 * 2048, pool, "lru", VllmOrder(sequential=True), router="round-robin")
    assert missed.engines[1].pool_hit_tokens == 0


def test_the_shared_pool_evicts_as_mooncakes_master_and_never_holds_more_than_its_capacity() -> None:
    trace = prepare(generate("system-prompts", seed=1, block_size=BLOCK, overrides={"requests": 60}))
    streams = split_streams(trace, 3, route(trace, 3, "round-robin"))
    order = VllmOrder(concurrency=2)
    small, large = (
        fleet_point(streams, GEOMETRY, 64 * 4096, TierSpec("mooncake", objects * POOL_OBJECT), "lru", order, router="round-robin")
        for objects in (40, 100_000)
    )  # fmt: skip
    assert small.report.counts is not None and large.report.counts is not None
    assert small.report.counts.tier_evictions > 0
    assert small.report.counts.tier_peak_chunks <= 40 < large.report.counts.tier_chunks
    assert large.report.counts.tier_evictions == 0
    assert small.pool_hit_tokens < large.pool_hit_tokens


def test_every_engines_counts_add_up_to_the_fleets() -> None:
    trace = prepare(generate("system-prompts", seed=2, block_size=BLOCK, overrides={"requests": 80}))
    streams = split_streams(trace, 4, route(trace, 4, "prefix-affinity", affinity_blocks=8))
    point = fleet_point(
        streams, GEOMETRY, 300 * 4096, TierSpec("mooncake", 2000 * POOL_OBJECT), "lru",
        VllmOrder(gpu_blocks=200, max_num_seqs=4, concurrency=2), router="prefix-affinity", affinity_blocks=8,
    )  # fmt: skip
    report, engines = point.report, point.engines
    assert report.counts is not None
    assert [each.requests for each in engines] == [len(stream) for stream in streams]
    assert sum(each.external_query_tokens for each in engines) == report.external_query_tokens
    assert point.host_hit_tokens == report.counts.host_loaded_chunks * BLOCK
    assert point.pool_hit_tokens == report.counts.tier_loaded_chunks * BLOCK
    assert point.prompt_tokens == sum(each.prompt_tokens for each in trace)
    assert point.computed_tokens == point.prompt_tokens - point.gpu_hit_tokens - report.external_hit_tokens
    assert point.pool_hit_tokens > 0 and point.host_hit_tokens > 0 and point.gpu_hit_tokens > 0


# -- one engine is the single-engine model ---------------------------------------------------------------------


@pytest.mark.parametrize("order", [VllmOrder(gpu_blocks=48, max_num_seqs=4, concurrency=4), VllmOrder(gpu_blocks=48, max_num_seqs=4)])  # fmt: skip
def test_a_fleet_of_one_engine_is_the_single_engine_tiered_model_exactly(order: VllmOrder) -> None:
    geometry = dataclasses.replace(PRESETS["llama-3-8b"], block_size=32)
    trace = prepare(generate("system-prompts", seed=0, block_size=32, overrides={"requests": 120}))
    host = 40 * geometry.tiered_chunk_bytes
    pool = TierSpec("mooncake", 120 * pool_object_bytes(geometry))
    point = fleet_point([trace], geometry, host, pool, "lru", order, router="round-robin")
    assert point.report == replay_tiered([trace], geometry, host, pool, "lru", order).report
    # And request by request through predict(), the one-engine entry point, on a pool of the same size.
    single = predict(
        [Request(each.req_id, hashes(each.prompt_keys), each.prompt_tokens, hashes(each.output_keys)) for each in trace],
        slots=40, block_size=32, policy="lru", model=order.server_model(), tier=pool.build(geometry),
    )  # fmt: skip
    assert single.tiers is not None
    (engine,) = point.engines
    assert engine.gpu_hit_tokens == single.gpu_hit_tokens
    assert engine.host_hit_tokens == single.tiers.host_loaded_chunks * 32
    assert engine.pool_hit_tokens == single.tiers.tier_loaded_chunks * 32
    assert engine.computed_tokens == single.prompt_tokens - single.gpu_hit_tokens - single.external_hit_tokens
    assert point.report.counts is not None and point.report.counts.tier_evictions > 0  # the pool did evict


def hashes(keys: tuple[OffloadKey, ...]) -> tuple[bytes, ...]:
    """The block hashes of offload keys: each key is its hash and 4 bytes of KV group."""
    return tuple(key[:-4] for key in keys)


def pool_object_bytes(geometry: ModelGeometry) -> int:
    return TierSpec("mooncake").object_bytes(geometry)


# -- where a larger pool stops paying ----------------------------------------------------------------------


def synthetic(
    pool_gib: float, computed: int, *, policy: str = "lru", host_gib: float = 1, stalled: bool = False
) -> FleetPoint:
    """A point whose one engine computed ``computed`` of 1000 prompt tokens (hit share 1 - computed/1000)."""
    report = TieredReport(
        policy=policy, servers=1, host_bytes=int(host_gib * GIB), host_blocks=1,
        tier=TierSpec("mooncake", int(pool_gib * GIB)), stalled=stalled, external_query_tokens=1000,
        external_hit_tokens=1000 - computed, counts=None, bytes_per_chunk=4096, tier_object_bytes=4160,
        host_evictions=0, host_load_bytes=0, host_store_bytes=0,
    )  # fmt: skip
    engine = EngineReport(0, 1, 1000, 0, 1000 - computed, 0, 1000, computed, 0, 0, 1)
    return FleetPoint("round-robin", None, report, () if stalled else (engine,))


def test_the_knee_is_the_smallest_pool_within_one_point_of_the_largest() -> None:
    # Hit shares 40%, 55%, 59.1%, 60% (largest): 59.1% is within 1 point of 60%, 55% is not.
    points = [synthetic(1, 600), synthetic(2, 450), synthetic(4, 409), synthetic(8, 400)]
    (knee,) = pool_knees(points)
    assert knee.knee is points[2] and knee.largest is points[3] and not knee.at_largest
    # Exactly one point below the largest is within it; a wider bound takes a smaller pool.
    (exact,) = pool_knees([synthetic(1, 600), synthetic(2, 410), synthetic(8, 400)])
    assert exact.knee is not None and exact.knee.pool.capacity_bytes == 2 * GIB
    (wide,) = pool_knees(points, within_points=5.0)
    assert wide.knee is points[1]


def test_the_knee_is_per_policy_and_host_size_skips_stalled_points_and_says_when_it_is_the_largest() -> None:
    points = [
        synthetic(1, 600), synthetic(2, 400),  # LRU at 1 GiB: still climbing at the largest pool
        synthetic(1, 400, policy="arc"), synthetic(2, 399, policy="arc"),  # ARC: the first pool is enough
        synthetic(1, 500, host_gib=2), synthetic(2, 0, host_gib=2, stalled=True),  # the largest stalled
        synthetic(1, 0, host_gib=4, stalled=True),  # nothing ran
    ]  # fmt: skip
    lru, arc, skipped, none = pool_knees(points)
    assert (lru.policy, lru.knee, lru.at_largest) == ("lru", points[1], True)
    assert (arc.policy, arc.knee, arc.at_largest) == ("arc", points[2], False)
    assert (skipped.host_bytes, skipped.knee, skipped.largest) == (2 * GIB, points[4], points[4])
    assert (none.knee, none.largest, none.at_largest) == (None, None, False)
    with pytest.raises(ValueError, match="within_points must be >= 0"):
        pool_knees(points, within_points=-1)


def test_the_answer_is_the_cheapest_point_whose_hit_share_reaches_the_target_not_vllms_rate() -> None:
    # Host memory priced 10x a pool GiB: 1 GiB host + 8 GiB pool costs 18, 1 + 2 costs 12, 4 + 2 costs 42.
    points = [synthetic(8, 300), synthetic(2, 450), synthetic(2, 290, host_gib=4)]
    # vLLM's rate counts only what the GPU did not serve: a point whose GPU served most has a low one.
    points[1] = dataclasses.replace(points[1], report=dataclasses.replace(points[1].report, external_hit_tokens=10))
    found = recommend_fleet(points, 0.5, 10.0, GEOMETRY)
    assert found.point is points[1] and found.best is points[2]
    assert found.extra_config is not None and found.extra_config["cpu_bytes_to_use"] == GIB
    assert found.extra_config["secondary_tiers"] == [
        {
            "type": "MooncakeStoreTier",
            "module_path": "kvtriton.integrations.mooncake",
            "master_server_address": "<mooncake_master host:port>",
        }
    ]
    assert recommend_fleet(points, 0.7, 10.0, GEOMETRY).point is points[0]  # 70%, cheaper than 71%
    assert recommend_fleet(points, 0.705, 10.0, GEOMETRY).point is points[2]
    missed = recommend_fleet(points, 0.9, 10.0, GEOMETRY)
    assert (missed.point, missed.best, missed.extra_config) == (None, points[2], None)
    with pytest.raises(ValueError, match="no fleet points"):
        recommend_fleet([], 0.5, 10.0, GEOMETRY)


def test_a_sweep_runs_every_policy_host_and_pool_size_in_order() -> None:
    trace = prepare([request("a", 1, 2), request("b", 1, 2, 3)])
    pools = [TierSpec("mooncake", 10 * POOL_OBJECT), TierSpec("mooncake", 20 * POOL_OBJECT)]
    points = fleet_sweep(
        split_streams(trace, 2, [0, 1]), GEOMETRY, [4 * 4096, 8 * 4096], pools, ["lru", "arc"],
        VllmOrder(sequential=True), router="round-robin",
    )  # fmt: skip
    assert [(p.policy, p.host_bytes // 4096, p.pool.capacity_bytes) for p in points] == [
        (policy, host, pool.capacity_bytes) for policy in ("lru", "arc") for host in (4, 8) for pool in pools
    ]


# -- what a long replay costs ----------------------------------------------------------------------------------


@pytest.fixture
def collector_enabled() -> Iterator[None]:
    """The cyclic collector on for the test, then as it was."""
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_the_collector_is_paused_while_a_fleet_replays_and_left_as_it_was(collector_enabled: None) -> None:
    seen: list[bool] = []
    trace = prepare(generate("system-prompts", seed=3, block_size=BLOCK, overrides={"requests": 12}))
    streams = split_streams(trace, 2, route(trace, 2, "round-robin"))
    fleet_point(
        streams, GEOMETRY, 64 * 4096, TierSpec("mooncake", 1000 * POOL_OBJECT), "lru", VllmOrder(concurrency=2),
        router="round-robin", on_finished=lambda _finished: seen.append(gc.isenabled()),
    )  # fmt: skip
    assert seen and not any(seen)  # every progress report came from inside the replay, the collector off
    assert gc.isenabled()
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # one that was off stays off
    with pytest.raises(RuntimeError, match="stop"), collector_paused():
        raise RuntimeError("stop")
    gc.enable()
    with pytest.raises(RuntimeError, match="stop"), collector_paused():
        raise RuntimeError("stop")
    assert gc.isenabled()  # back on after a replay that raised (a stalled point raises through it)
