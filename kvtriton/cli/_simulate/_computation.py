"""`kvtriton simulate`'s computation: the sweeps and their answers, from what the arguments selected; no output."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtriton.cli._simulate._arguments import holding_a_block
from kvtriton.manager import CPUOffloadingManager
from kvtriton.sim import (
    CallOrder,
    ModelGeometry,
    PointReport,
    PreparedRequest,
    Recommendation,
    ReplayStats,
    Request,
    ServerStats,
    TieredRecommendation,
    TieredReport,
    TierSpec,
    TraceSummary,
    Track,
    VllmOrder,
    default_capacities,
    prepare,
    recommend,
    recommend_tiered,
    summarize,
    sweep,
    tiered_sweep,
)


@dataclass(frozen=True, slots=True)
class HostSweep:
    """A sweep of host memory sizes (no second tier): every point per compression, the ceiling, the answers."""

    geometry: ModelGeometry
    """The uncompressed geometry."""
    stored: ModelGeometry
    """The geometry the recommendation is for: the compressed one when asked, else ``geometry``."""
    order: CallOrder
    summary: TraceSummary
    capacities: list[int]
    unlimited: ReplayStats
    """The replay with room for every distinct block: the ceiling."""
    unlimited_server: ServerStats | None
    """The same replay's server counts (vLLM's order only)."""
    curves: dict[str, list[PointReport]]
    """The points per compression (``none``, then the compressed rows when asked)."""
    found: Recommendation
    """The answer for ``stored``'s rows."""
    uncompressed: Recommendation
    """The answer with uncompressed rows (the same as ``found`` without compression)."""

    @property
    def reports(self) -> list[PointReport]:
        return [report for curve in self.curves.values() for report in curve]

    @property
    def unlimited_rate(self) -> float:
        """The ceiling's rate: the one vLLM reports in its order, the token hit rate in kvtriton's."""
        server = self.unlimited_server
        return server.external_hit_rate if server is not None else self.unlimited.token_hit_rate

    @property
    def working_set(self) -> int:
        """The bytes every distinct block takes, uncompressed."""
        return self.summary.distinct_blocks * self.geometry.bytes_per_block

    @property
    def stored_working_set(self) -> int:
        """The bytes every distinct block takes as ``stored``'s rows."""
        return self.summary.distinct_blocks * self.stored.stored_bytes_per_block


def host_sweep(
    requests: Sequence[Request],
    geometries: Sequence[ModelGeometry],
    capacities: Sequence[int] | None,
    policies: Sequence[str],
    order: CallOrder,
    *,
    bandwidth_gbps: float,
    target_hit_rate: float,
    tensor_parallel_size: int,
    track: Track,
) -> HostSweep:
    """Every (policy, capacity) point per geometry (the last is recommended), the ceiling, and the answers.

    ``capacities`` None: the default sizes for the trace. ValueError for a size
    that holds no block; ValueError or RuntimeError from the server model.
    """
    geometry, stored = geometries[0], geometries[-1]
    prepared = prepare(requests)
    summary = summarize(prepared)
    sizes = holding_a_block(list(capacities or default_capacities(geometry, summary.distinct_blocks)), geometry)
    # The ceiling: capacity for every distinct block, so nothing is ever evicted.
    unlimited, unlimited_server = order.replay(
        prepared, CPUOffloadingManager(max(summary.distinct_blocks, 1), cache_policy="lru"), geometry.block_size
    )
    curves = {
        each.compression: [
            PointReport.of(point, each, bandwidth_gbps)
            for point in sweep(prepared, each, sizes, policies, order=order, track=track)
        ]
        for each in geometries
    }
    tp = tensor_parallel_size
    server = order if isinstance(order, VllmOrder) else None
    found = recommend(
        curves[stored.compression], target_hit_rate, order.name, stored, tensor_parallel_size=tp, server=server
    )
    uncompressed = recommend(
        curves["none"], target_hit_rate, order.name, geometry, tensor_parallel_size=tp, server=server
    )
    return HostSweep(geometry, stored, order, summary, sizes, unlimited, unlimited_server, curves, found, uncompressed)


@dataclass(frozen=True, slots=True)
class TieredSweep:
    """A sweep of (policy, host size, tier size) points behind a second tier, and its cheapest point."""

    streams: list[list[PreparedRequest]]
    """One request stream per server."""
    distinct_blocks: int
    """Distinct blocks over every stream."""
    reports: list[TieredReport]
    found: TieredRecommendation


def tiered_points(
    streams: Sequence[Sequence[Request]],
    geometry: ModelGeometry,
    hosts: Sequence[int] | None,
    tiers: Callable[[int], list[TierSpec]],
    policies: Sequence[str],
    order: VllmOrder,
    *,
    target_hit_rate: float,
    host_price_ratio: float,
    default_points: int,
    on_start: Callable[[list[list[PreparedRequest]], list[int], list[TierSpec]], Callable[[int], None]],
) -> TieredSweep:
    """Every tiered point of ``streams``, and the cheapest reaching the target.

    ``hosts`` None: ``default_points`` sizes for the trace; ``tiers(distinct
    blocks)`` the tier sizes. ``on_start(streams, hosts, tiers)`` is called
    before the replays and returns what each finished request is told to (a
    progress bar). ValueError or RuntimeError for what cannot run.
    """
    prepared = [prepare(stream) for stream in streams]
    distinct = summarize([request for stream in prepared for request in stream]).distinct_blocks
    tier_sizes = tiers(distinct)
    for tier in tier_sizes:
        tier.build(geometry)  # refuses a pool that holds no chunk
    host_sizes = holding_a_block(list(hosts or default_capacities(geometry, distinct, default_points)), geometry)
    on_finished = on_start(prepared, host_sizes, tier_sizes)
    reports = tiered_sweep(prepared, geometry, host_sizes, tier_sizes, policies, order, on_finished=on_finished)
    found = recommend_tiered(reports, target_hit_rate, host_price_ratio, geometry, server=order)
    return TieredSweep(prepared, distinct, reports, found)
