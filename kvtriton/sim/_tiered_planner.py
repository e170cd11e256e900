"""The planner across tiers: a trace swept over (host size, tier size), each point reported as vLLM's metrics would.

:func:`tiered_sweep` replays the trace behind the server model once per
(policy, host size, tier size) with a :class:`~kvtriton.sim._secondary_tier.TieredManager`
per server, every server's manager in front of one shared tier (``--servers``:
one request stream per server, all feeding one Mooncake pool).
:class:`TieredReport` holds the rates and bytes each tier serves;
:func:`recommend_tiered` picks the cheapest point that reaches a target, host
memory priced :data:`DEFAULT_HOST_PRICE_RATIO` times a tier GiB, and writes
the ``kv_connector_extra_config`` of ``KVTritonTieringOffloadingSpec`` for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass

from kvtriton._offload_types import ReqContext
from kvtriton.manager import CPUOffloadingManager
from kvtriton.sim._geometry import GIB, ModelGeometry
from kvtriton.sim._planner import VllmOrder, host_extra_config
from kvtriton.sim._replay import PreparedRequest, positioned_contexts
from kvtriton.sim._secondary_tier import SecondaryTier, TierCounts, TieredManager, tiered_calls
from kvtriton.sim._tier_models import TierSpec, tier_extra_config
from kvtriton.sim._vllm_server import ServerModel, ServerStats, ServerStream, StalledRequest, replay_vllm_servers

TieredTrack = Callable[[Sequence[tuple[str, int, TierSpec]]], Iterable[tuple[str, int, TierSpec]]]
"""Wraps a tiered sweep's (policy, host size, tier) grid as it is replayed (the command's progress bar)."""

DEFAULT_HOST_PRICE_RATIO = 10.0
"""A GiB of host DRAM costs this many GiB of the second tier: server DRAM against NVMe is about 30x per GiB,
against a Mooncake pool's DRAM (cheaper, denser holders, shared by every server) about 3x; 10 sits between.
``--host-price-ratio`` sets it."""

TIERING_SPEC_EXTRA_CONFIG: dict[str, object] = {
    "spec_name": "KVTritonTieringOffloadingSpec",
    "spec_module_path": "kvtriton.integrations.vllm",
}
"""The keys that make kvtriton the primary tier of vLLM's tiered offloading (docs/tiers.md)."""


@dataclass(frozen=True, slots=True)
class Stall:
    """Why a tiered point stalled: the request that never ran, its prompt against the host tier, what evicted it."""

    req_id: str
    prompt_chunks: int
    host_chunks: int
    """The host tier's capacity in chunks (one server's)."""
    own_evictions: int
    """Chunks the request had looked up that its own promotions evicted while it waited."""

    @property
    def fits(self) -> bool:
        """The prompt fits the host tier: it stalled on its own evictions, not for want of room."""
        return self.prompt_chunks <= self.host_chunks


@dataclass(frozen=True, slots=True)
class TieredReport:
    """One (policy, host size, tier size) point over every server, as vLLM's metrics report it; rates are fractions."""

    policy: str
    servers: int
    host_bytes: int
    """Each server's host tier (``cpu_bytes_to_use``)."""
    host_blocks: int
    tier: TierSpec
    stalled: bool
    """A request was deferred without end (its prefix does not fit the host tier): no rate is meaningful."""
    external_query_tokens: int
    external_hit_tokens: int
    """Loaded into the GPU from the host tier, promoted chunks included: vLLM's ``external_prefix_cache_hits``."""
    counts: TierCounts | None
    """Both tiers' chunk counts, summed over servers (None when stalled)."""
    bytes_per_chunk: int
    """One chunk's host row (compressed with compression): what each tier copy moves."""
    tier_object_bytes: int
    """What one chunk takes in the tier (its model's ``object_overhead_bytes`` more: Mooncake's 64-byte seal)."""
    host_evictions: int
    """Host chunks evicted for the GPU's stores and for promotions."""
    host_load_bytes: int
    """Host tier to GPU (``vllm:kv_offload_load_bytes``): every external hit, promoted chunks included."""
    host_store_bytes: int
    """GPU to host tier (``vllm:kv_offload_store_bytes``); promotions write the host tier too, counted as tier reads."""
    compression: str = "none"
    block_size: int = 16
    """Tokens per chunk (one block each)."""
    stall: Stall | None = None
    """With ``stalled``: the request that never ran and why."""

    @property
    def external_hit_rate(self) -> float:
        """The combined rate vLLM reports: ``external_prefix_cache_hits / external_prefix_cache_queries``."""
        return self.external_hit_tokens / self.external_query_tokens if self.external_query_tokens else 0.0

    def _count(self, name: str) -> int:
        return 0 if self.counts is None else int(getattr(self.counts, name))

    @property
    def host_chunk_hit_rate(self) -> float:
        """``chunk_hits / chunk_queries`` of tier ``0:primary``."""
        queries = self._count("host_chunk_queries")
        return self._count("host_chunk_hits") / queries if queries else 0.0

    @property
    def tier_chunk_hit_rate(self) -> float:
        """``chunk_hits / chunk_queries`` of tier ``1:<kind>`` (``1:fs``, ``1:mooncake``)."""
        queries = self._count("tier_chunk_queries")
        return self._count("tier_chunk_hits") / queries if queries else 0.0

    @property
    def host_served_rate(self) -> float:
        """Share of the queried prompt tokens loaded from chunks the host tier held (vLLM's ``host`` source)."""
        return self._served("host_loaded_chunks")

    @property
    def tier_served_rate(self) -> float:
        """Share of the queried prompt tokens loaded from chunks promoted from the tier; with
        :attr:`host_served_rate`, the combined :attr:`external_hit_rate`."""
        return self._served("tier_loaded_chunks")

    def _served(self, name: str) -> float:
        queries = self.external_query_tokens
        return self._count(name) * self.block_size / queries if queries else 0.0

    @property
    def tier_read_bytes(self) -> int:
        """``vllm:kv_offload_tiering_read_bytes``: promoted chunks."""
        return self._count("promotions") * self.bytes_per_chunk

    @property
    def tier_write_bytes(self) -> int:
        """``vllm:kv_offload_tiering_write_bytes``: cascaded chunks."""
        return self._count("cascaded_chunks") * self.bytes_per_chunk

    @property
    def tier_fill_bytes(self) -> int:
        """What the tier holds at the end: for one without capacity (``fs``), what it filled over the trace."""
        return self._count("tier_chunks") * self.tier_object_bytes

    @property
    def tier_size_bytes(self) -> int:
        """The tier's size as bought: its capacity (a Mooncake pool's), or for one without (``fs``) what it filled."""
        return self.tier.capacity_bytes if self.tier.capacity_bytes is not None else self.tier_fill_bytes

    def cost(self, host_price_ratio: float) -> float:
        """In tier-GiB: every server's host memory at ``host_price_ratio`` times a tier GiB, plus the tier."""
        return (self.servers * self.host_bytes * host_price_ratio + self.tier_size_bytes) / GIB


@dataclass(frozen=True, slots=True)
class TieredReplay:
    """One point's replay: its report, and (unless it stalled) each server's stats and manager."""

    report: TieredReport
    stats: Sequence[ServerStats]
    managers: Sequence[TieredManager]


def replay_tiered(
    streams: Sequence[Sequence[PreparedRequest]],
    geometry: ModelGeometry,
    host_bytes: int,
    tier: TierSpec,
    policy: str,
    order: VllmOrder,
    *,
    server_streams: Callable[[Sequence[TieredManager]], list[ServerStream[ReqContext]]] | None = None,
    on_finished: Callable[[int], None] | None = None,
) -> TieredReplay:
    """One point: every stream behind its own host tier of ``host_bytes``, all in front of one fresh ``tier``.

    The streams are replayed as ``server_streams`` makes them over the servers' managers (None: each request
    with its positioned context); the one replay of a tiered sweep's point and of a fleet's point.
    ``on_finished`` counts the requests as they finish (see :func:`tiered_sweep`); a stalled point reports the
    requests it will never finish at once, so that every point counts all of its requests.
    """

    def positioned_streams(managers: Sequence[TieredManager]) -> list[ServerStream[ReqContext]]:
        return [
            ServerStream(
                tiered_calls(manager),
                requests,
                positioned_contexts(requests, lambda req_id: ReqContext(req_id=req_id), block_size=geometry.block_size),
            )
            for manager, requests in zip(managers, streams)
        ]

    shared = tier.build(geometry)
    blocks = host_bytes // geometry.tiered_chunk_bytes
    server = order.server_model()
    managers = managers_over(shared, len(streams), blocks, policy, server)
    stalled = TieredReport(
        policy=policy,
        servers=len(streams),
        host_bytes=host_bytes,
        host_blocks=blocks,
        tier=tier,
        stalled=True,
        external_query_tokens=0,
        external_hit_tokens=0,
        counts=None,
        bytes_per_chunk=geometry.tiered_chunk_bytes,
        tier_object_bytes=tier.object_bytes(geometry),
        host_evictions=0,
        host_load_bytes=0,
        host_store_bytes=0,
        compression=geometry.compression,
        block_size=geometry.block_size,
    )
    finished = 0

    def count(requests: int) -> None:
        nonlocal finished
        finished += requests
        if on_finished is not None:
            on_finished(requests)

    try:
        with collector_paused():
            stats = replay_vllm_servers(
                (server_streams or positioned_streams)(managers),
                block_size=geometry.block_size,
                model=server,
                on_finished=count,
            )
    except StalledRequest as stuck:
        if on_finished is not None:
            on_finished(sum(len(requests) for requests in streams) - finished)
        own = max(manager.own_evictions(stuck.req_id) for manager in managers)
        return TieredReplay(
            dataclasses.replace(stalled, stall=Stall(stuck.req_id, stuck.prompt_blocks, blocks, own)), (), ()
        )
    report = dataclasses.replace(
        stalled,
        stalled=False,
        external_query_tokens=sum(each.external_query_tokens for each in stats),
        external_hit_tokens=sum(each.external_hit_tokens for each in stats),
        counts=summed_counts([manager.counts() for manager in managers]),
        host_evictions=sum(each.replay.evictions for each in stats)
        + sum(manager.promotion_evictions for manager in managers),
        host_load_bytes=sum(each.replay.hit_blocks for each in stats) * geometry.stored_bytes_per_block,
        host_store_bytes=sum(each.replay.blocks_stored for each in stats) * geometry.stored_bytes_per_block,
    )
    return TieredReplay(report, stats, managers)


@contextlib.contextmanager
def collector_paused() -> Generator[None]:
    """Python's cyclic garbage collector off while the block runs, then as it was.

    A tiered replay allocates millions of objects that outlive many steps (each request's context, lookups and
    stores) and makes no reference cycles: with the collector off, a 30,000-request fleet replay left under
    20,000 objects for it, the replay's results included. Each of the collector's passes still walks the
    young objects and what they point to, which costs more as the heap grows: 17% of a 100-engine fleet's
    replay at 10,000 requests, 27% at 100,000 (``bench/fleet_scale.py``'s point, CPU time), so the cost per
    request rose with the trace's length. Reference counting frees everything the replay drops, collector or not.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_SHARED_TIER_COUNTS = ("kind", "tier_chunks", "tier_peak_chunks", "tier_evictions", "tier_refused_puts")
"""The :class:`TierCounts` fields about the one shared tier itself; every other field is one server's traffic."""


def managers_over(
    tier: SecondaryTier, servers: int, blocks: int, policy: str, server: ServerModel
) -> list[TieredManager]:
    """One host tier of ``blocks`` chunks under ``policy`` per server, each vLLM's tiering in front of the one
    shared ``tier``, with the rules of ``server``'s vLLM."""
    return [
        TieredManager(
            CPUOffloadingManager(blocks, cache_policy=policy), tier, stores_mark_present=server.stores_mark_present
        )
        for _ in range(servers)
    ]


def summed_counts(counts: Sequence[TierCounts]) -> TierCounts:
    """Every server's counts added up; the tier's own (what it holds, evicts, refuses) are the one shared tier's."""
    first = counts[0]  # every manager reads the one shared tier, so its own counts are the same in each
    per_server = {
        field.name: sum(getattr(each, field.name) for each in counts)
        for field in dataclasses.fields(TierCounts)
        if field.name not in _SHARED_TIER_COUNTS
    }
    # The peak is each manager's own sample of the tier (taken at its steps): the highest one is the tier's.
    return dataclasses.replace(first, **per_server, tier_peak_chunks=max(each.tier_peak_chunks for each in counts))


def tiered_sweep(
    streams: Sequence[Sequence[PreparedRequest]],
    geometry: ModelGeometry,
    host_capacities: Sequence[int],
    tiers: Sequence[TierSpec],
    policies: Sequence[str],
    order: VllmOrder,
    *,
    track: TieredTrack | None = None,
    on_finished: Callable[[int], None] | None = None,
) -> list[TieredReport]:
    """Every (policy, host size, tier) point, each on fresh host tiers and a fresh tier.

    ``track`` wraps the grid of points; ``on_finished`` is told how many requests finished, as they do, over
    every point (:func:`sweep_requests` in all): the finer unit for a progress bar, since one point of a
    long trace or of many servers can take minutes.
    """
    grid = [(policy, host, tier) for policy in policies for host in host_capacities for tier in tiers]
    return [
        replay_tiered(streams, geometry, host, tier, policy, order, on_finished=on_finished).report
        for policy, host, tier in (grid if track is None else track(grid))
    ]


def sweep_requests(
    streams: Sequence[Sequence[PreparedRequest]],
    host_capacities: Sequence[int],
    tiers: Sequence[TierSpec],
    policies: Sequence[str],
) -> int:
    """How many requests a :func:`tiered_sweep` replays in all: every server's stream at every point."""
    return len(policies) * len(host_capacities) * len(tiers) * sum(len(stream) for stream in streams)


@dataclass(frozen=True, slots=True)
class TieredRecommendation:
    """The cheapest point that reaches the target, and its vLLM configuration."""

    target: float
    host_price_ratio: float
    point: TieredReport | None
    """None when no point tried reaches the target."""
    best: TieredReport
    """The point with the highest rate (the closest one when none reaches the target)."""
    extra_config: dict[str, object] | None


def recommend_tiered(
    reports: Sequence[TieredReport],
    target: float,
    host_price_ratio: float,
    geometry: ModelGeometry,
    *,
    server: VllmOrder | None = None,
) -> TieredRecommendation:
    """The point of least :meth:`TieredReport.cost` whose combined rate reaches ``target`` (then the higher rate).

    ``server``: the server model the points ran behind, whose connector settings the config carries.
    """
    if not reports:
        raise ValueError("no sweep points to choose from")
    if not host_price_ratio > 0:
        raise ValueError(f"host_price_ratio must be positive, got {host_price_ratio!r}")
    usable = [report for report in reports if not report.stalled] or list(reports)
    best = max(usable, key=lambda report: (report.external_hit_rate, -report.cost(host_price_ratio)))
    reaching = [report for report in usable if not report.stalled and report.external_hit_rate >= target - 1e-12]
    if not reaching:
        return TieredRecommendation(target, host_price_ratio, None, best, None)
    point = min(reaching, key=lambda report: (report.cost(host_price_ratio), -report.external_hit_rate))
    extra = host_extra_config(TIERING_SPEC_EXTRA_CONFIG, point.host_bytes, point.policy, geometry)
    if server is not None:
        extra.update(server.connector_settings(point.host_bytes, geometry))
    extra["secondary_tiers"] = [tier_extra_config(point.tier)]
    return TieredRecommendation(target, host_price_ratio, point, best, extra)
