"""`kvtriton simulate`'s computation: the sweeps and their answers, from what the arguments selected; no output."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtriton.cli._simulate._arguments import DEFAULT_TIERED_POINTS, holding_a_block, tier_specs
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
class TierGrid:
    """What a tiered or a fleet sweep tries, and the rule that picks its cheapest point."""

    geometry: ModelGeometry
    hosts: Sequence[int] | None
    """Host sizes (per server or engine); None: the default sizes for the trace."""
    tiers: Callable[[int], list[TierSpec]]
    """The second tier's sizes for a trace of so many distinct blocks."""
    policies: Sequence[str]
    order: VllmOrder
    target_hit_rate: float
    host_price_ratio: float

    @classmethod
    def of(cls, args: argparse.Namespace, geometry: ModelGeometry, order: VllmOrder) -> TierGrid:
        return cls(
            geometry,
            args.capacities,
            lambda distinct: tier_specs(args, geometry, distinct),
            args.policies,
            order,
            args.target_hit_rate,
            args.host_price_ratio,
        )

    def sizes(self, distinct_blocks: int) -> tuple[list[int], list[TierSpec]]:
        """The host sizes and the tier sizes for a trace of ``distinct_blocks``; ValueError for a host size that holds
        no block or a tier that holds no chunk, before any replay."""
        tier_sizes = self.tiers(distinct_blocks)
        for tier in tier_sizes:
            tier.build(self.geometry)
        hosts = self.hosts or default_capacities(self.geometry, distinct_blocks, DEFAULT_TIERED_POINTS)
        return holding_a_block(list(hosts), self.geometry), tier_sizes


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
    grid: TierGrid,
    *,
    on_start: Callable[[list[list[PreparedRequest]], list[int], list[TierSpec]], Callable[[int], None]],
) -> TieredSweep:
    """Every point of ``grid`` over ``streams``, and the cheapest reaching the target.

    ``on_start(streams, hosts, tiers)`` is called before the replays and returns what each finished request is
    told to (a progress bar). ValueError or RuntimeError for what cannot run.
    """
    prepared = [prepare(stream) for stream in streams]
    distinct = summarize([request for stream in prepared for request in stream]).distinct_blocks
    host_sizes, tier_sizes = grid.sizes(distinct)
    on_finished = on_start(prepared, host_sizes, tier_sizes)
    reports = tiered_sweep(
        prepared, grid.geometry, host_sizes, tier_sizes, grid.policies, grid.order, on_finished=on_finished
    )
    found = recommend_tiered(reports, grid.target_hit_rate, grid.host_price_ratio, grid.geometry, server=grid.order)
    return TieredSweep(prepared, distinct, reports, found)
