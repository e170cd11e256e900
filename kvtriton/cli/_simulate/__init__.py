"""`kvtriton simulate`: how many cache hits a given amount of host memory buys, for a trace.

Replays a request trace (a built-in synthetic workload or a JSON-lines file)
through ``CPUOffloadingManager`` for a sweep of capacities and each eviction
policy, calling the manager the way a serving engine does, and reports hit
rates, bytes moved, evictions and refused stores per point, then the vLLM
configuration of the smallest size that reaches ``--target-hit-rate``. Pure
scheduler side: no tensors, no torch, so a sweep takes seconds. The replay
loops (:mod:`kvtriton.sim._replay`, :mod:`kvtriton.sim._vllm_order`) are
also what ``bench/manager.py`` times, for kvtriton's manager and vLLM's.

With ``--call-order vllm`` (implied by ``--gpu-blocks``, ``--max-num-seqs``
and ``--sequential``) the trace runs through a model of a vLLM 0.33 server
(:mod:`kvtriton.sim._vllm_server`): its admission, its own GPU prefix cache
in front of the offload tier, and its asynchronous loads and stores, so the
hit rate reported is the one vLLM's metrics show
(``external_prefix_cache_hits / external_prefix_cache_queries``).

With ``--engines N`` (:mod:`kvtriton.cli._simulate._fleet`) the trace is
routed (round-robin, or by a hash of the prompt's first blocks) to N engines,
each the server model above with its own host tier, all sharing one Mooncake
pool: each engine's hits, the pool size past which a larger pool stops
paying, and every engine's ``vllm serve`` line.

With ``--compression fp8-e4m3`` (lossy) every size is swept twice: with
uncompressed rows and with fp8-e4m3 rows, whose bytes per block come from the
compression format itself (:meth:`ModelGeometry.with_compression`, the only
step that imports torch), so a size holds about 1.9x the blocks and every
copy moves about 0.52x the bytes (bf16). The table, the JSON and the plot
show both; the recommendation is the compressed one, its
``kv_connector_extra_config`` carrying ``kvtriton_kv_compression``.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvtriton.cli._main import command_error
from kvtriton.cli._simulate import _arguments
from kvtriton.cli._simulate._arguments import (
    Source,
    call_order_of,
    compressed_geometries,
    geometry_of,
    given_flags,
    load_trace,
    server_streams,
)
from kvtriton.cli._simulate._computation import TierGrid, host_sweep, tiered_points
from kvtriton.cli._simulate._fleet import Routing, fleet_lines, fleet_points, fleet_record, fleet_routing
from kvtriton.cli._simulate._output import (
    SweepProgress,
    host_lines,
    host_plot,
    host_record,
    plot,
    plot_stamp,
    run_tier_sweep,
    tiered_lines,
    tiered_record,
    write_and_print,
)
from kvtriton.sim import (
    DEFAULT_HOST_PRICE_RATIO,
    ModelGeometry,
    Request,
    VllmOrder,
    sweep_requests,
    tier_choices,
)

__all__ = ["add_arguments", "plot_stamp", "run"]

_plot = plot
"""The plot, by the name tests/cli/test_simulate_cli.py reaches it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _arguments.add_arguments(parser, (__doc__ or "").split("\n\n")[0].removeprefix("`kvtriton simulate`: "))


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        geometry = geometry_of(args)
        geometries = [geometry, *compressed_geometries(args, geometry)]
        order = call_order_of(args)
        source, requests = load_trace(args, geometry.block_size)
    except (ValueError, OSError) as error:
        return command_error("simulate", error)
    stored = geometries[-1]  # the geometry the recommendation is for: the compressed one when asked
    try:
        routing = fleet_routing(args)  # after call_order_of, which names --engines itself under kvtriton's order
    except ValueError as error:
        return command_error("simulate", error)
    # --engines and --tier select vLLM's order (call_order_of); --engines sets --tier (fleet_routing)
    if args.tier is not None and isinstance(order, VllmOrder):
        return _run_tiered(args, stored, order, routing, source, requests, started)
    tier_only = given_flags(
        ("--tier-sizes", args.tier_sizes is not None),
        ("--host-price-ratio", args.host_price_ratio != DEFAULT_HOST_PRICE_RATIO),
        ("--servers", args.servers != 1),
    )
    if tier_only:
        return command_error("simulate", f"{tier_only[0]} applies with --tier ({tier_choices()})")
    try:
        result = host_sweep(
            requests,
            geometries,
            args.capacities,
            args.policies,
            order,
            bandwidth_gbps=args.bandwidth,
            target_hit_rate=args.target_hit_rate,
            tensor_parallel_size=args.tensor_parallel_size,
            track=SweepProgress(args),
        )
    except (ValueError, RuntimeError) as error:  # the server model refuses a request the GPU cache cannot hold
        return command_error("simulate", error)
    record = host_record(args, source, started, result)
    json_path = write_and_print(args, f"simulate-{source.name}.json", record, host_lines(source, result))
    if json_path is None:
        return 2
    # The answer first: the plot comes after it, so a missing or failing plot costs only the picture.
    written = [json_path]
    if not args.no_plot:
        try:
            png_path = host_plot(args, source, result, record)
        except OSError as error:
            return command_error("simulate", f"--out {args.out}: cannot write the plot: {error}")
        if png_path is not None:
            written.append(png_path)
    wrote = "wrote " + " and ".join(str(path) for path in written)
    if args.json:
        print(wrote, file=sys.stderr)
    else:
        print()
        print(wrote)
    return 0


def _run_tiered(
    args: argparse.Namespace,
    geometry: ModelGeometry,
    order: VllmOrder,
    routing: Routing | None,
    source: Source,
    requests: list[Request],
    started: float,
) -> int:
    """``--tier``: the (policy, host size, tier size) sweep, a table per policy, the cheapest point as vLLM's config;
    with ``--engines N`` (``routing``) a fleet's sweep, the knees, each engine, every engine's line."""
    grid = TierGrid.of(args, geometry, order)
    if routing is not None:
        return run_tier_sweep(
            args,
            f"simulate-{source.name}-fleet.json",
            lambda start_bar: fleet_points(requests, routing, grid, on_start=start_bar),
            lambda result: fleet_record(args, source, started, result, geometry, order),
            lambda result: fleet_lines(args, source, result, geometry, order),
        )
    return run_tier_sweep(
        args,
        f"simulate-{source.name}-tiered.json",
        lambda start_bar: tiered_points(
            server_streams(args, geometry.block_size, requests),
            grid,
            on_start=lambda streams, hosts, tiers: start_bar(sweep_requests(streams, hosts, tiers, args.policies)),
        ),
        lambda result: tiered_record(args, source, started, result, geometry, order),
        lambda result: tiered_lines(args, source, result, geometry, order),
    )
