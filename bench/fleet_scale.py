"""Fleet simulation cost: 100 engines sharing one Mooncake pool, seconds against requests (issue 49).

``kvtriton simulate --engines N`` replays every engine through the
single-engine server model in lockstep (``kvtriton.sim.fleet_point``). This
benchmark times one fleet point at increasing request counts (10k, 100k and
1M by default) and reports, per count, the replay's seconds (wall clock and
this process's CPU time: the machine may be shared, and its load average is
recorded beside each point), requests per second and microseconds per request,
then the growth: ``per_request_growth``, the time per request of the largest
count over the smallest's (1.0: linear in requests), and the exponent b of
seconds = a * requests^b fitted by least squares on the logarithms. Each
request count is a fresh fleet on a fresh trace; only the replay is timed
(the trace's generation and routing are recorded beside it). A point that
runs longer than :data:`PROGRESS_SECONDS` prints its progress as it goes.

The trace: the ``system-prompts`` workload (Zipf-popular system prompts, each
request ending in a unique user message; 16-token blocks, about 56 blocks a
request), drawn in streams of :data:`STREAM_REQUESTS` requests that share the
popular prompts (as ``--servers`` draws them), routed round-robin to the
engines. Each engine: Llama-3-8B's geometry, 2048 GPU blocks with its prefix
cache on, ``max_num_seqs`` 16, a client keeping 8 requests in flight
(``--arrivals concurrency:8`` at every engine), 4 GiB of host memory (LRU);
one 1 TiB Mooncake pool behind them all.

``--quick`` is a smoke run: 10 engines, a few hundred requests per count,
written to ``fleet_scale-quick.json``, never over the measured results.

    python -m bench.fleet_scale                  # 100 engines; 10k, 100k and 1M requests
    python -m bench.fleet_scale --requests 10000,100000
    python -m bench.fleet_scale --quick          # smoke run -> bench/results/fleet_scale-quick.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import resource
import sys
import time
from collections.abc import Sequence
from typing import cast

from bench.common import bench_parser, command_line, format_table, result_name, write_json
from kvtriton.sim import (
    GIB,
    PRESETS,
    PreparedRequest,
    TierSpec,
    VllmOrder,
    fleet_point,
    generate,
    prepare,
    route,
    split_streams,
)

__all__ = [
    "FULL_REQUESTS",
    "QUICK_REQUESTS",
    "Progress",
    "build_parser",
    "fitted_exponent",
    "main",
    "per_request_growth",
    "trace",
]

FULL_REQUESTS = (10_000, 100_000, 1_000_000)
QUICK_REQUESTS = (200, 400, 800)
FULL_ENGINES = 100
QUICK_ENGINES = 10
STREAM_REQUESTS = 10_000
"""Requests drawn per workload stream: the trace is generated and prepared a stream at a time, so the block hashes
of a million requests are never all held before their offload keys replace them."""
WORKLOAD = "system-prompts"
BLOCK_SIZE = 16
HOST_BYTES = 4 * GIB
POOL = TierSpec("mooncake", 1024 * GIB)
ORDER = VllmOrder(gpu_blocks=2048, max_num_seqs=16, concurrency=8)
PROGRESS_SECONDS = 30.0
"""A point's replay prints a progress line this often (a million requests take minutes)."""


def trace(requests: int, seed: int = 0) -> list[PreparedRequest]:
    """``requests`` requests of the workload, stream after stream; each id names its stream (ids repeat across)."""
    prepared: list[PreparedRequest] = []
    stream = 0
    while len(prepared) < requests:
        count = min(STREAM_REQUESTS, requests - len(prepared))
        drawn = generate(WORKLOAD, seed=seed, block_size=BLOCK_SIZE, overrides={"requests": count}, stream=stream)
        prepared += [dataclasses.replace(each, req_id=f"s{stream}-{each.req_id}") for each in prepare(drawn)]
        stream += 1
    return prepared


def fitted_exponent(requests: Sequence[int], seconds: Sequence[float]) -> float | None:
    """b of seconds = a * requests^b, least squares on the logarithms (None below two distinct counts)."""
    xs = [math.log(count) for count in requests]
    ys = [math.log(max(value, 1e-9)) for value in seconds]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if len(xs) < 2 or spread == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread


def per_request_growth(requests: Sequence[int], seconds: Sequence[float]) -> float | None:
    """Time per request at the largest count over that at the smallest (1.0: linear; None below two counts)."""
    if len(requests) < 2:
        return None
    smallest = min(range(len(requests)), key=requests.__getitem__)
    largest = max(range(len(requests)), key=requests.__getitem__)
    if requests[smallest] == requests[largest] or seconds[smallest] <= 0:
        return None
    return (seconds[largest] / requests[largest]) / (seconds[smallest] / requests[smallest])


class Progress:
    """Counts a replay's finished requests and prints a line every ``every`` seconds: done, rate, time left."""

    def __init__(self, total: int, every: float = PROGRESS_SECONDS) -> None:
        self.total = total
        self.every = every
        self.done = 0
        self.started = time.perf_counter()
        self._next = self.started + every

    def __call__(self, finished: int) -> None:
        self.done += finished
        now = time.perf_counter()
        if now < self._next or self.done >= self.total:
            return
        self._next = now + self.every
        elapsed = now - self.started
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate else math.inf
        print(
            f"  {self.done:,} of {self.total:,} requests ({100 * self.done / self.total:.0f}%) in {elapsed:.0f} s:"
            f" {rate:,.0f} requests/s, about {left:.0f} s left",
            flush=True,
        )


def _peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def measure(requests: int, engines: int) -> dict[str, object]:
    """One fleet point of ``requests`` requests on ``engines`` engines: the replay's seconds and what it counted."""
    started = time.perf_counter()
    requests_trace = trace(requests)
    streams = split_streams(requests_trace, engines, route(requests_trace, engines, "round-robin"))
    prepared_seconds = time.perf_counter() - started
    gc.collect()
    load_before = os.getloadavg()[0]
    progress = Progress(requests)
    started, cpu_started = time.perf_counter(), time.process_time()
    point = fleet_point(
        streams, PRESETS["llama-3-8b"], HOST_BYTES, POOL, "lru", ORDER, router="round-robin", on_finished=progress
    )
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    counts = point.report.counts
    return {
        "requests": requests,
        "engines": engines,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "requests_per_second": requests / seconds,
        "us_per_request": 1e6 * seconds / requests,
        "cpu_us_per_request": 1e6 * cpu_seconds / requests,
        "load_average": [load_before, os.getloadavg()[0]],
        "trace_seconds": prepared_seconds,
        "prompt_blocks": sum(len(each.prompt_keys) for each in requests_trace),
        "stalled": point.stalled,
        "hit_share": point.hit_share,
        "pool_hit_share": point.share(point.pool_hit_tokens),
        "host_hit_share": point.share(point.host_hit_tokens),
        "gpu_hit_share": point.share(point.gpu_hit_tokens),
        "pool_evictions": counts.tier_evictions if counts is not None else None,
        "peak_rss_bytes": _peak_rss_bytes(),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("fleet_scale", __doc__, quick="10 engines, a few hundred requests")
    parser.add_argument(
        "--requests",
        type=lambda text: [int(item) for item in text.split(",")],
        help=f"request counts to time, comma-separated (default: {','.join(map(str, FULL_REQUESTS))};"
        f" --quick: {','.join(map(str, QUICK_REQUESTS))})",
    )
    parser.add_argument(
        "--engines", type=int, help=f"engines in the fleet (default: {FULL_ENGINES}; --quick: {QUICK_ENGINES})"
    )
    return parser


def _record(
    args: argparse.Namespace, argv: Sequence[str] | None, counts: Sequence[int], rows: Sequence[dict[str, object]]
) -> dict[str, object]:
    requests = [int(str(row["requests"])) for row in rows]
    seconds = [float(str(row["seconds"])) for row in rows]
    cpu_seconds = [float(str(row["cpu_seconds"])) for row in rows]
    return {
        "command": command_line("fleet_scale", argv),
        "quick": args.quick,
        "complete": len(rows) == len(counts),
        "requests_asked": list(counts),
        "workload": WORKLOAD,
        "block_size": BLOCK_SIZE,
        "host_bytes_per_engine": HOST_BYTES,
        "pool_bytes": POOL.capacity_bytes,
        "server": dataclasses.asdict(ORDER),
        "cpu_count": os.cpu_count(),
        "rows": list(rows),
        "per_request_growth": per_request_growth(requests, seconds),
        "cpu_per_request_growth": per_request_growth(requests, cpu_seconds),
        "fitted_exponent": fitted_exponent(requests, seconds),
        "total_seconds": sum(seconds),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    counts: list[int] = sorted(args.requests or (QUICK_REQUESTS if args.quick else FULL_REQUESTS))
    engines: int = args.engines or (QUICK_ENGINES if args.quick else FULL_ENGINES)
    if any(count < 1 for count in counts) or engines < 1:
        raise SystemExit(f"--requests and --engines must be positive, got {counts} and {engines}")
    name = result_name(args)
    rows: list[dict[str, object]] = []
    for count in counts:
        print(f"{count:,} requests on {engines} engines: generating the trace, then the replay", flush=True)
        row = measure(count, engines)
        rows.append(row)
        print(
            f"{count:,} requests on {engines} engines: {row['seconds']:.1f} s ({row['cpu_seconds']:.1f} s of CPU),"
            f" {row['requests_per_second']:,.0f} requests/s, {row['us_per_request']:.0f} us per request",
            flush=True,
        )
        # Written after every count ("complete": false until the last): a long run stopped early keeps what it timed.
        write_json(name, _record(args, argv, counts, rows))
    record = _record(args, argv, counts, rows)
    path = write_json(name, record)
    print()
    print(
        format_table(
            ["requests", "engines", "seconds", "CPU s", "requests/s", "us/request", "load", "hit share",
             "pool hit share", "peak RSS GiB"],
            [
                [row["requests"], row["engines"], row["seconds"], row["cpu_seconds"], row["requests_per_second"],
                 row["us_per_request"], max(cast("list[float]", row["load_average"])), row["hit_share"],
                 row["pool_hit_share"], int(str(row["peak_rss_bytes"])) / GIB]
                for row in rows
            ],
        )
    )  # fmt: skip
    growth, exponent = record["per_request_growth"], record["fitted_exponent"]
    if isinstance(growth, float) and isinstance(exponent, float):
        print(
            f"growth: {growth:.2f}x the time per request from {counts[0]:,} to {counts[-1]:,} requests (1.00: linear);"
            f" fitted seconds ~ requests^{exponent:.2f}"
        )
    else:
        print("growth: n/a (one request count)")
    if args.quick:
        print("SMOKE RUN (--quick): the figures only show the benchmark works")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
