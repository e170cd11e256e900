"""`kvtriton simulate --engines N`: a fleet behind a router sharing one Mooncake pool; its sweep, lines and record."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvtriton.cli._simulate._arguments import (
    Source,
    given_flags,
)
from kvtriton.cli._simulate._computation import TierGrid
from kvtriton.cli._simulate._output import (
    describe_server,
    gib,
    lossy_tiers_lines,
    offloading_transfer_config,
    percent,
    properties,
    record_of,
    serve_command_lines,
    table,
    tier_record_fields,
    tier_sweep_lines,
    tiered_point_record,
    unreached_lines,
)
from kvtriton.sim import (
    DEFAULT_AFFINITY_BLOCKS,
    DEFAULT_ROUTER,
    POOL_KNEE_POINTS,
    FleetPoint,
    FleetRecommendation,
    ModelGeometry,
    PoolKnee,
    PreparedRequest,
    Request,
    RouterName,
    TierSpec,
    VllmOrder,
    fleet_sweep,
    format_bytes,
    pool_knees,
    prepare,
    recommend_fleet,
    route,
    split_streams,
    summarize,
)

POOL_TIER = "mooncake"
"""The tier a fleet shares when ``--tier`` is not given: one Mooncake pool."""


@dataclass(frozen=True, slots=True)
class Routing:
    """How the trace reaches the engines: ``--engines``, ``--router`` and (prefix-affinity) ``--affinity-blocks``."""

    engines: int
    router: RouterName
    affinity_blocks: int | None
    """None for a router that reads no prefix (round-robin)."""

    def describe(self) -> str:
        if self.affinity_blocks is None:
            return self.router
        return f"{self.router} (a hash of the prompt's first {self.affinity_blocks} blocks picks the engine)"


def fleet_routing(args: argparse.Namespace) -> Routing | None:
    """The fleet the flags ask for (None: no ``--engines``); ValueError naming a flag that does not apply.

    With ``--engines`` and no ``--tier``, sets ``args.tier`` to an unsized Mooncake pool (its sizes are then
    ``--tier-sizes``'s), so that the record and the answer name the pool the fleet shares.
    """
    if args.engines is None:
        stray = given_flags(
            ("--router", args.router is not None), ("--affinity-blocks", args.affinity_blocks is not None)
        )
        if stray:
            raise ValueError(f"{stray[0]} routes a fleet's requests: it applies with --engines N")
        return None
    if args.servers != 1:
        raise ValueError(
            f"--servers {args.servers} gives each server a request stream of its own; --engines {args.engines}"
            " routes one trace to N engines: give one of them"
        )
    tier: TierSpec | None = args.tier
    if tier is not None and not tier.model.sized:
        raise ValueError(
            f"--engines shares one pool with a capacity; --tier {tier.describe()} has none: give --tier"
            f" {POOL_TIER}[:SIZE] (or leave --tier out, which is {POOL_TIER})"
        )
    router: RouterName = args.router or DEFAULT_ROUTER
    if args.affinity_blocks is not None and router != "prefix-affinity":
        raise ValueError(
            f"--affinity-blocks {args.affinity_blocks} is the prefix the prefix-affinity router hashes; it does not"
            f" apply to --router {router}: add --router prefix-affinity or leave --affinity-blocks out"
        )
    if tier is None:
        args.tier = TierSpec(POOL_TIER)
    affinity = (args.affinity_blocks or DEFAULT_AFFINITY_BLOCKS) if router == "prefix-affinity" else None
    return Routing(args.engines, router, affinity)


@dataclass(frozen=True, slots=True)
class FleetSweep:
    """Every (policy, host size per engine, pool size) point of a fleet, the knees and the cheapest point."""

    routing: Routing
    trace: list[PreparedRequest]
    streams: list[list[PreparedRequest]]
    """Each engine's requests, as the router sent them."""
    distinct_blocks: int
    points: list[FleetPoint]
    knees: list[PoolKnee]
    found: FleetRecommendation
    """The cheapest point whose hit share reaches the target."""


def fleet_points(
    requests: Sequence[Request], routing: Routing, grid: TierGrid, *, on_start: Callable[[int], Callable[[int], None]]
) -> FleetSweep:
    """Route the trace, replay every point of ``grid``, read the knees and the cheapest point reaching the target.

    ``on_start(requests to replay)`` returns what each finished request is told to (a progress bar).
    """
    trace = prepare(requests)
    distinct = summarize(trace).distinct_blocks
    host_sizes, pools = grid.sizes(distinct)
    assignment = route(
        trace, routing.engines, routing.router, affinity_blocks=routing.affinity_blocks or DEFAULT_AFFINITY_BLOCKS
    )
    streams = split_streams(trace, routing.engines, assignment)
    on_finished = on_start(len(grid.policies) * len(host_sizes) * len(pools) * len(trace))
    points = fleet_sweep(
        streams,
        grid.geometry,
        host_sizes,
        pools,
        grid.policies,
        grid.order,
        router=routing.router,
        affinity_blocks=routing.affinity_blocks,
        on_finished=on_finished,
    )
    found = recommend_fleet(points, grid.target_hit_rate, grid.host_price_ratio, grid.geometry, server=grid.order)
    return FleetSweep(routing, trace, streams, distinct, points, pool_knees(points), found)


def _fleet_rows(points: Sequence[FleetPoint], ratio: float) -> tuple[list[str], list[list[str]]]:
    headers = ["policy", "host GiB", "pool GiB", "hit share", "GPU", "host hit", "pool hit", "computed",
               "vLLM hit", "pool evictions", "refused puts", "cost"]  # fmt: skip  # a table: the header row as printed
    rows: list[list[str]] = []
    for point in points:
        report = point.report
        counts = report.counts
        size = gib(point.pool.capacity_bytes or 0)
        if counts is None:  # stalled: the replay stopped, so there is nothing to count
            rows.append([point.policy, gib(point.host_bytes), size, "stalled", *["-"] * 8])
            continue
        rows.append(
            [
                point.policy,
                gib(point.host_bytes),
                size,
                percent(point.hit_share),
                percent(point.share(point.gpu_hit_tokens)),
                percent(point.share(point.host_hit_tokens)),
                percent(point.share(point.pool_hit_tokens)),
                percent(point.share(point.computed_tokens)),
                percent(report.external_hit_rate),
                str(counts.tier_evictions),
                str(counts.tier_refused_puts),
                f"{report.cost(ratio):.3g}",
            ]
        )
    return headers, rows


def knee_lines(knees: Sequence[PoolKnee]) -> list[str]:
    """Per (policy, host size): the pool size past which a larger pool stops paying, by the stated rule."""
    within = knees[0].within_points if knees else POOL_KNEE_POINTS
    lines = [
        f"pool size that stops paying: the smallest pool whose hit share is within {within:g} point of the"
        " largest pool tried (hit share: the fleet's prompt tokens no engine computed)"
    ]
    for knee in knees:
        pair = f"  {knee.policy.upper()}, host {format_bytes(knee.host_bytes)} per engine:"
        point, largest = knee.knee, knee.largest
        if point is None or largest is None:
            lines.append(f"{pair} every pool size stalled")
            continue
        size = format_bytes(point.pool.capacity_bytes or 0)
        if knee.at_largest:
            lines.append(
                f"{pair} {size}, the largest pool that ran ({percent(point.hit_share)}): a larger pool may still"
                " pay; try larger --tier-sizes"
            )
            continue
        lines.append(
            f"{pair} {size} ({percent(point.hit_share)}; the largest, {format_bytes(largest.pool.capacity_bytes or 0)},"
            f" {percent(largest.hit_share)})"
        )
    return lines


def engine_lines(point: FleetPoint) -> list[str]:
    """Each engine's requests and where its prompt tokens came from, then the fleet's total."""
    headers = ["engine", "requests", "prompt tokens", "computed tokens", "GPU", "host hit", "pool hit",
               "computed", "promoted", "cascaded"]  # fmt: skip  # a table: the header row as printed

    def row(name: str, requests: int, prompt: int, gpu: int, host: int, pool: int, computed: int, promoted: int,
            cascaded: int) -> list[str]:  # fmt: skip
        def share(tokens: int) -> str:
            return percent(tokens / prompt if prompt else 0.0)

        return [name, str(requests), str(prompt), str(computed), share(gpu), share(host), share(pool),
                share(computed), str(promoted), str(cascaded)]  # fmt: skip

    rows = [
        row(str(each.engine), each.requests, each.prompt_tokens, each.gpu_hit_tokens, each.host_hit_tokens,
            each.pool_hit_tokens, each.computed_tokens, each.promoted_chunks, each.cascaded_chunks)
        for each in point.engines
    ]  # fmt: skip
    engines = point.engines
    rows.append(
        row("fleet", sum(each.requests for each in engines), point.prompt_tokens, point.gpu_hit_tokens,
            point.host_hit_tokens, point.pool_hit_tokens, point.computed_tokens,
            sum(each.promoted_chunks for each in engines), sum(each.cascaded_chunks for each in engines))
    )  # fmt: skip
    return [
        f"per engine at {point.policy.upper()}, host {format_bytes(point.host_bytes)} per engine,"
        f" {point.pool.describe()} pool (shares of each engine's prompt tokens; promoted, cascaded: chunks it read"
        " from and wrote to the pool):",
        *table(headers, rows),
    ]


def fleet_lines(
    args: argparse.Namespace, source: Source, result: FleetSweep, geometry: ModelGeometry, order: VllmOrder
) -> list[str]:
    """What a fleet sweep prints: the trace and its routing, a table per policy, the knees, each engine, the answer."""
    routing = result.routing
    per_engine = [len(stream) for stream in result.streams]
    lines = tier_sweep_lines(
        args,
        source,
        summarize(result.trace),
        geometry,
        result.distinct_blocks,
        [
            f"server    each engine: {describe_server(order)}",
            f"fleet     {routing.engines} engines behind {routing.describe()}: {min(per_engine)} to {max(per_engine)}"
            f" requests per engine",
            f"tiers     host memory per engine, then {args.tier.model.heading}, shared by {routing.engines} engines",
        ],
        lambda policy: _fleet_rows([p for p in result.points if p.policy == policy], args.host_price_ratio),
        "hit share, GPU, host hit, pool hit, computed: shares of the fleet's prompt tokens (the first is every"
        " token no engine computed); vLLM hit: external hits over external queries, summed over the engines",
        [point.report for point in result.points if point.stalled],
    )
    lines.append("")
    lines += knee_lines(result.knees)
    shown = result.found.point or result.found.best
    if not shown.stalled:
        lines.append("")
        lines += engine_lines(shown)
    lines.append("")
    lines += answer_lines(result.found, order, geometry, args.tensor_parallel_size, per_engine)
    return lines


def answer_lines(
    found: FleetRecommendation,
    order: VllmOrder,
    geometry: ModelGeometry,
    tensor_parallel_size: int,
    engine_requests: Sequence[int],
) -> list[str]:
    """The cheapest point reaching the target: its configuration once, then every engine's `vllm serve` line, and
    the pool to provision; or why no point reached it."""
    target = percent(found.target)
    price = f"host memory priced {found.host_price_ratio:g}x a pool GiB"
    point = found.point
    if point is None or found.extra_config is None:
        best = found.best
        return unreached_lines(
            f"the fleet's hit share stays below {target} ({price})",
            f"{percent(best.hit_share)} ({best.policy.upper()}, host {format_bytes(best.host_bytes)} per engine,"
            f" {best.pool.describe()} pool)",
        )
    pool = point.pool.model
    pool_size = format_bytes(point.pool.capacity_bytes or 0)
    flags = order.engine_settings(geometry.block_size, tensor_parallel_size).flags()
    lines = [
        f"cheapest point reaching a hit share of {target} ({price}): {format_bytes(point.host_bytes)} of host memory"
        f" per engine with {point.policy.upper()} and {pool.bought_as.format(size=pool_size)} shared by"
        f" {len(engine_requests)} engines, {percent(point.hit_share)} (vLLM hit {percent(point.report.external_hit_rate)};"
        f" cost {point.report.cost(found.host_price_ratio):.3g} pool-GiB)",
        "",
        "kv_connector_extra_config (every engine's):",
        "  " + json.dumps(found.extra_config),
        "",
    ]
    for engine, requests in enumerate(engine_requests):
        lines.append(f"# engine {engine} of {len(engine_requests)} ({requests} requests routed to it)")
        lines += serve_command_lines(offloading_transfer_config(found.extra_config), flags)
    lines += [
        f"/dev/shm:  the tiering spec maps its host memory there: about {format_bytes(point.host_bytes)} free on each"
        " engine's machine",
        pool.deployment.format(size=pool_size),
        *lossy_tiers_lines(geometry),
    ]
    return lines


def _fleet_point_record(point: FleetPoint, ratio: float) -> dict[str, object]:
    return {
        **tiered_point_record(point.report, ratio),
        **properties(
            point,
            ("hit_share", "prompt_tokens", "gpu_hit_tokens", "host_hit_tokens", "pool_hit_tokens", "computed_tokens"),
        ),
        "engines": [asdict(engine) for engine in point.engines],
    }


def fleet_record(
    args: argparse.Namespace,
    source: Source,
    started: float,
    result: FleetSweep,
    geometry: ModelGeometry,
    order: VllmOrder,
) -> dict[str, object]:
    """The JSON record of a fleet sweep: every point with each engine's counts, the knees, the answer."""
    found, routing = result.found, result.routing
    ratio = args.host_price_ratio
    return record_of(
        args,
        source,
        started,
        engines=routing.engines,
        router=routing.router,
        affinity_blocks=routing.affinity_blocks,
        requests_per_engine=[len(stream) for stream in result.streams],
        **tier_record_fields(args, geometry, order, result.distinct_blocks),
        points=[_fleet_point_record(point, ratio) for point in result.points],
        pool_knee={
            "rule": "the smallest pool whose hit share is within within_points percentage points of the largest"
            " pool tried, per policy and host size",
            "within_points": POOL_KNEE_POINTS,
            "knees": [
                {
                    "policy": knee.policy,
                    "host_bytes": knee.host_bytes,
                    "pool_bytes": knee.knee.pool.capacity_bytes if knee.knee is not None else None,
                    "hit_share": knee.knee.hit_share if knee.knee is not None else None,
                    "largest_pool_bytes": knee.largest.pool.capacity_bytes if knee.largest is not None else None,
                    "largest_hit_share": knee.largest.hit_share if knee.largest is not None else None,
                    "at_largest": knee.at_largest,
                }
                for knee in result.knees
            ],
        },
        recommendation={
            "target_hit_rate": found.target,
            "reached": found.point is not None,
            "rate": "hit share: the share of the fleet's prompt tokens no engine computes",
            "point": _fleet_point_record(found.point, ratio) if found.point is not None else None,
            "kv_connector_extra_config": found.extra_config,
            "pool_bytes": found.point.pool.capacity_bytes if found.point is not None else None,
        },
    )
