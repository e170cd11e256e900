"""`kvtriton simulate`'s fleet model against three real vLLM engines sharing one real Mooncake pool.

The seeded workload of :mod:`e2e.fidelity_table` is written as a trace, read
back by the simulator's parser and routed by the fleet model's own router
(:func:`kvtriton.sim._router.route`: round-robin, and prefix-affinity on the
first block, which every request of one system prompt shares) to three
engines. Each engine is vLLM with ``KVTritonTieringOffloadingSpec``, its own
host tier (three tenths of the trace's distinct blocks, LRU) and kvtriton's Mooncake
Store tier in one namespace of one pool per router, so that each engine finds
the chunks the others cascaded.

Arrival discipline: **the engines run in turn**, each serving its whole
stream one request at a time (the next request sent once the previous one
finished), then stepping until every cascade has landed in the pool, then
shutting down before the next engine starts (:mod:`e2e.tiered_fidelity_engine`,
one process: an engine's restart leaves an empty GPU cache and host tier, so
the three runs are three engines). Why: three vLLM engines alive at once are
three processes of about a core each on a two-core machine, and engines
stepping side by side interleave their pool writes by wall-clock timing,
which no two runs repeat; in turn, every pool lookup sees exactly the chunks
the engines before it stored, so two runs measure the same figures.

The prediction models the same order with the fleet model's parts: the
router's streams, one :class:`~kvtriton.sim._secondary_tier.TieredManager`
per engine over one :class:`~kvtriton.sim._secondary_tier.MooncakePool`
(:func:`kvtriton.sim._tiered_planner.managers_over`), each engine's stream
replayed through the server model (``--arrivals concurrency:1``) after the
previous engine's, its figures read as
:class:`kvtriton.sim._fleet.EngineReport`. ``kvtriton simulate --engines 3``
itself replays the engines side by side, in lockstep
(:func:`kvtriton.sim._fleet.fleet_point`): that prediction is printed beside
the measurement too (``lockstep``), to show how much the order matters; it is
not the one the bound applies to.

Per engine it compares, as shares of the engine's prompt tokens: host hits
(``vllm:prompt_tokens_cached_by_source`` ``host``), pool hits (its
``external_unspecified``: chunks promoted from Mooncake for the request),
GPU prefix-cache hits (``vllm:prefix_cache_hits``) and the tokens the engine
computed (prompt tokens less each request's ``num_cached_tokens``); for the
pool, the fleet's pool hits and the chunks the engines wrote to it and read
from it (``vllm:kv_offload_tiering_write_bytes`` / ``_read_bytes`` of the
Mooncake tier, in chunk objects).

Run as a command it prints the table (it starts its own Mooncake cluster)::

    PYTHONPATH=.:tests .venv/bin/python -m e2e.fleet_fidelity
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.tiny_models import TinyLlama
from e2e.engine import run_process, spec_config
from e2e.fidelity_table import LOCAL_HITS, QUERIES, FidelitySetup, distinct_blocks, kv_bytes_per_block, workload
from e2e.tiered_fidelity import CACHED_BY_SOURCE, SOURCES, TieredSetup, tier_config, tier_model
from kvtriton._offload_types import ReqContext
from kvtriton.integrations._vllm_release import installed_vllm_version
from kvtriton.sim._fleet import EngineReport
from kvtriton.sim._replay import PreparedRequest, positioned_contexts, prepare
from kvtriton.sim._router import RouterName, route
from kvtriton.sim._secondary_tier import SecondaryTier, tiered_calls
from kvtriton.sim._tiered_planner import managers_over
from kvtriton.sim._token_trace import TokenRequest, write_trace
from kvtriton.sim._vllm_server import ServerModel, ServerStats, ServerStream, replay_vllm_server, replay_vllm_servers
from kvtriton.sim._workloads import read_trace
from kvtriton.worker import RegionLayout

ONE_AT_A_TIME = "one at a time"
"""Each engine's arrival mode (:data:`e2e.tiered_fidelity.MODES`)."""
READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
POOL_TIER = "1:"
"""The prefix of the Mooncake tier's ``tier`` label (``1:MooncakeStoreTier``)."""

GPU = "GPU hits"
HOST = "host hits"
POOL = "pool hits"
COMPUTED = "computed"
SHARES = (GPU, HOST, POOL, COMPUTED)
"""Where each engine's prompt tokens came from, as shares of them; the four add up to one."""


@dataclass(frozen=True, slots=True)
class FleetSetup:
    """The workload, the fleet's size and routers, and each engine's host tier."""

    tiered: TieredSetup = dataclasses.field(
        default_factory=lambda: TieredSetup(engine=FidelitySetup(requests=120), host_share=0.3)
    )
    """The engine's settings and its host tier's share of the trace's distinct blocks (one rule with the single
    engine check: :meth:`e2e.tiered_fidelity.TieredSetup.host_slots`)."""
    engines: int = 3
    routers: tuple[RouterName, ...] = ("round-robin", "prefix-affinity")
    affinity_blocks: int = 1
    """The prefix-affinity router's K: the first block, which every request of one system prompt shares (the
    workload's system prompts are 2 to 8 blocks long), so a system prompt's requests meet on one engine."""

    @property
    def block_size(self) -> int:
        return self.tiered.engine.block_size

    def server_model(self) -> ServerModel:
        """Each engine's settings in the simulator: the single-engine check's, one request at a time."""
        return self.tiered.server_model(ONE_AT_A_TIME)


def engine_shares(report: EngineReport) -> dict[str, float]:
    prompt = report.prompt_tokens
    return {
        GPU: report.gpu_hit_tokens / prompt,
        HOST: report.host_hit_tokens / prompt,
        POOL: report.pool_hit_tokens / prompt,
        COMPUTED: report.computed_tokens / prompt,
    }


def pool_traffic(reports: Sequence[EngineReport]) -> dict[str, int]:
    """The chunks a fleet's engines wrote to the pool and read from it."""
    return {
        "written": sum(report.cascaded_chunks for report in reports),
        "read": sum(report.promoted_chunks for report in reports),
    }


@dataclass(frozen=True, slots=True)
class FleetComparison:
    """One router's fleet: each engine as measured, as predicted in the engines' order, and as the lockstep fleet
    model predicts it."""

    router: RouterName
    slots: int
    measured: tuple[EngineReport, ...]
    predicted: tuple[EngineReport, ...]
    lockstep: tuple[EngineReport, ...]

    def gap_points(self, engine: int, share: str) -> float:
        """Measured minus predicted (in turn), in percentage points of the engine's prompt tokens."""
        return 100.0 * (engine_shares(self.measured[engine])[share] - engine_shares(self.predicted[engine])[share])

    def pool_hit_gap_points(self) -> float:
        """The fleet's pool hits, measured minus predicted, in points of the fleet's prompt tokens."""
        prompt = sum(report.prompt_tokens for report in self.measured)
        measured = sum(report.pool_hit_tokens for report in self.measured)
        predicted = sum(report.pool_hit_tokens for report in self.predicted)
        return 100.0 * (measured - predicted) / prompt

    def describe(self) -> str:
        lines = [f"{self.router} ({self.slots} host chunks per engine):"]
        for measured, predicted in zip(self.measured, self.predicted, strict=True):
            mine, theirs = engine_shares(measured), engine_shares(predicted)
            lines.append(
                f"  engine {measured.engine} ({measured.requests} requests, {measured.prompt_tokens} prompt tokens): "
                + ", ".join(
                    f"{share} {100 * mine[share]:.2f}% measured, {100 * theirs[share]:.2f}% predicted"
                    f" ({self.gap_points(measured.engine, share):+.2f} pt)"
                    for share in SHARES
                )
                + f"; pool chunks written {measured.cascaded_chunks} / {predicted.cascaded_chunks},"
                f" read {measured.promoted_chunks} / {predicted.promoted_chunks} (measured / predicted)"
            )
        lines.append(f"  fleet pool hits: {self.pool_hit_gap_points():+.2f} pt")
        return "\n".join(lines)


def fleet_streams(
    requests: Sequence[TokenRequest], trace: Sequence[PreparedRequest], setup: FleetSetup, router: RouterName
) -> tuple[list[list[TokenRequest]], list[list[PreparedRequest]]]:
    """Each engine's requests as the fleet model's router sends them: the engines' prompts, and the model's."""
    assignment = route(trace, setup.engines, router, affinity_blocks=setup.affinity_blocks)
    prompts: list[list[TokenRequest]] = [[] for _ in range(setup.engines)]
    prepared: list[list[PreparedRequest]] = [[] for _ in range(setup.engines)]
    for request, each, engine in zip(requests, trace, assignment, strict=True):
        prompts[engine].append(request)
        prepared[engine].append(each)
    return prompts, prepared


def _contexts(requests: Sequence[PreparedRequest], block_size: int) -> list[ReqContext]:
    return positioned_contexts(requests, lambda req_id: ReqContext(req_id=req_id), block_size=block_size)


def predict_in_turn(
    streams: Sequence[Sequence[PreparedRequest]], setup: FleetSetup, slots: int, pool: SecondaryTier
) -> tuple[EngineReport, ...]:
    """Each engine behind its own host tier of ``slots`` chunks, all in front of ``pool``, replayed one engine after
    the other (each until its last cascade landed)."""
    server = setup.server_model()
    managers = managers_over(pool, len(streams), slots, "lru", server)
    reports: list[EngineReport] = []
    for engine, (requests, manager) in enumerate(zip(streams, managers, strict=True)):
        stats = replay_vllm_server(
            tiered_calls(manager), requests, _contexts(requests, setup.block_size),
            block_size=setup.block_size, model=server,
        )  # fmt: skip
        reports.append(EngineReport.of(engine, stats, manager, setup.block_size))
    return tuple(reports)


def predict_lockstep(
    streams: Sequence[Sequence[PreparedRequest]], setup: FleetSetup, slots: int, pool: SecondaryTier
) -> tuple[EngineReport, ...]:
    """The same fleet as ``kvtriton simulate --engines N`` replays it: every engine side by side, one scheduler step
    each in turn (:func:`kvtriton.sim._fleet.fleet_point`'s replay)."""
    server = setup.server_model()
    managers = managers_over(pool, len(streams), slots, "lru", server)
    stats: list[ServerStats] = replay_vllm_servers(
        [
            ServerStream(tiered_calls(manager), requests, _contexts(requests, setup.block_size))
            for manager, requests in zip(managers, streams, strict=True)
        ],
        block_size=setup.block_size,
        model=server,
    )
    return tuple(
        EngineReport.of(engine, each, manager, setup.block_size)
        for engine, (each, manager) in enumerate(zip(stats, managers, strict=True))
    )


def measured_report(
    engine: int, run: dict[str, Any], prompts: Sequence[TokenRequest], chunk_object_bytes: int
) -> EngineReport:
    """One engine's figures from its counters, in the fleet model's terms."""
    counters: dict[str, float] = run["counters"]
    by_label: dict[str, dict[str, float]] = run["tier_counters"]
    sources = by_label.get(CACHED_BY_SOURCE, {})
    prompt_tokens = sum(len(request.prompt) for request in prompts)

    def pool_chunks(counter: str) -> int:
        pool_bytes = sum(value for label, value in by_label.get(counter, {}).items() if label.startswith(POOL_TIER))
        chunks, odd = divmod(int(pool_bytes), chunk_object_bytes)
        if odd:
            raise AssertionError(
                f"{counter} of the pool is {pool_bytes} bytes, not whole {chunk_object_bytes}-byte chunks"
            )
        return chunks

    return EngineReport(
        engine=engine,
        requests=len(prompts),
        prompt_tokens=prompt_tokens,
        gpu_hit_tokens=int(counters.get(LOCAL_HITS, 0.0)),
        host_hit_tokens=int(sources.get("host", 0.0)),
        pool_hit_tokens=int(sources.get(SOURCES["mooncake"], 0.0)),
        external_query_tokens=int(counters.get(QUERIES, 0.0)),
        computed_tokens=prompt_tokens - sum(int(tokens) for tokens in run["cached_tokens"]),
        promoted_chunks=pool_chunks(READ_BYTES),
        cascaded_chunks=pool_chunks(WRITE_BYTES),
        steps=0,  # the engine does not count its steps
    )


def measure(
    model_dir: Path,
    fleets: dict[RouterName, list[list[TokenRequest]]],
    setup: FleetSetup,
    *,
    slots: int,
    workdir: Path,
    mooncake_master: str,
) -> dict[RouterName, list[dict[str, Any]]]:
    """Per router, its engines in turn in one namespace of the pool (all in one process): each engine's result."""
    engine = setup.tiered.engine
    slot_bytes = kv_bytes_per_block(TinyLlama(), engine.block_size)
    host_bytes = slots * RegionLayout.block_row_stride_for(1, 1, slot_bytes)
    runs: list[dict[str, object]] = [
        {
            "prompts": [list(request.prompt) for request in stream],
            "concurrency": 1,
            "kv_transfer_config": spec_config(
                "KVTritonTieringOffloadingSpec",
                cpu_bytes_to_use=host_bytes,
                eviction_policy="lru",
                secondary_tiers=[tier_config("mooncake", f"fleet {router}", workdir, mooncake_master)],
            ),
        }
        for router, streams in fleets.items()
        for stream in streams
    ]
    job = {
        "model": str(model_dir),
        "block_size": engine.block_size,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "gpu_blocks": engine.gpu_blocks,
        "kv_cache_bytes": 16 << 20,
        "max_tokens": engine.max_tokens,
        "all_at_once": False,
        "runs": runs,
    }
    raw, _ = run_process("e2e.tiered_fidelity_engine", job, workdir, label="the fleet fidelity engines")
    results: list[dict[str, Any]] = raw["runs"]
    for run in results:
        if run["num_slots"] != slots or run["gpu_blocks"] != engine.gpu_blocks:
            raise AssertionError(
                f"the engine is not the one simulated: {run['num_slots']} host chunks and {run['gpu_blocks']} GPU"
                f" blocks, asked for {slots} and {engine.gpu_blocks}"
            )
    return {router: results[index * setup.engines : (index + 1) * setup.engines] for index, router in enumerate(fleets)}


def compare(
    setup: FleetSetup, model_dir: Path, workdir: Path, *, mooncake_master: str, pool_bytes: int, progress: bool = False
) -> list[FleetComparison]:
    """Every router of ``setup``: the engines measured in turn on one pool, against the prediction in the same order."""
    block_size = setup.block_size
    requests = workload(setup.tiered.engine)
    workdir.mkdir(parents=True, exist_ok=True)
    trace = prepare(read_trace(write_trace(workdir / "trace.jsonl", requests, block_size), block_size=block_size))
    slots = setup.tiered.host_slots(requests)
    fleets: dict[RouterName, tuple[list[list[TokenRequest]], list[list[PreparedRequest]]]] = {
        router: fleet_streams(requests, trace, setup, router) for router in setup.routers
    }
    measured = measure(
        model_dir, {router: prompts for router, (prompts, _) in fleets.items()}, setup,
        slots=slots, workdir=workdir, mooncake_master=mooncake_master,
    )  # fmt: skip
    chunk_bytes = RegionLayout.block_row_stride_for(1, 1, kv_bytes_per_block(TinyLlama(), block_size))
    comparisons: list[FleetComparison] = []
    for router, (prompts, streams) in fleets.items():
        pool = tier_model("mooncake", pool_bytes, chunk_bytes)
        predicted = predict_in_turn(streams, setup, slots, pool)
        lockstep = predict_lockstep(streams, setup, slots, tier_model("mooncake", pool_bytes, chunk_bytes))
        comparison = FleetComparison(
            router, slots,
            tuple(measured_report(index, run, prompts[index], chunk_bytes) for index, run in enumerate(measured[router])),
            predicted, lockstep,
        )  # fmt: skip
        comparisons.append(comparison)
        if progress:
            print(comparison.describe(), file=sys.stderr, flush=True)
    return comparisons


def markdown(setup: FleetSetup, comparisons: Sequence[FleetComparison], distinct: int) -> str:
    engine = setup.tiered.engine
    lines = [
        f"{engine.requests} requests (seed {engine.seed}), {distinct} distinct blocks of {engine.block_size} tokens,"
        f" routed to {setup.engines} engines (prefix-affinity on the first {setup.affinity_blocks} block) that run in"
        f" turn, one request at a time, on one Mooncake pool; each engine: {comparisons[0].slots} host chunks (LRU),"
        f" {engine.gpu_blocks} GPU blocks with its prefix cache on. Shares of each engine's prompt tokens; predicted"
        " with the engines in the same order; lockstep: the engines side by side, as `kvtriton simulate --engines 3`"
        " replays them.",
        "",
        "| router | engine | requests | figure | predicted | measured (vLLM) | measured - predicted | lockstep |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for comparison in comparisons:
        for measured, predicted, lockstep in zip(
            comparison.measured, comparison.predicted, comparison.lockstep, strict=True
        ):
            mine, theirs, side = engine_shares(measured), engine_shares(predicted), engine_shares(lockstep)
            for share in SHARES:
                lines.append(
                    f"| {comparison.router} | {measured.engine} | {measured.requests} | {share}"
                    f" | {100 * theirs[share]:.2f}% | {100 * mine[share]:.2f}%"
                    f" | {comparison.gap_points(measured.engine, share):+.2f} pt | {100 * side[share]:.2f}% |"
                )
        traffic = {side: pool_traffic(reports) for side, reports in (
            ("measured", comparison.measured), ("predicted", comparison.predicted), ("lockstep", comparison.lockstep)
        )}  # fmt: skip
        for name in traffic["measured"]:
            chunks = {side: counts[name] for side, counts in traffic.items()}
            lines.append(
                f"| {comparison.router} | pool | | chunks {name} | {chunks['predicted']} | {chunks['measured']}"
                f" | {chunks['measured'] - chunks['predicted']:+d} | {chunks['lockstep']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.fleet_fidelity",
        description="simulate's fleet model against three real vLLM engines on one Mooncake pool, as markdown",
    )
    default = FleetSetup()
    parser.add_argument("--requests", type=int, default=default.tiered.engine.requests, help="requests in the workload")
    args = parser.parse_args(argv)
    setup = dataclasses.replace(
        default,
        tiered=dataclasses.replace(
            default.tiered, engine=dataclasses.replace(default.tiered.engine, requests=args.requests)
        ),
    )
    from kvtriton.integrations._mooncake_local import MooncakeCluster

    with tempfile.TemporaryDirectory(prefix="kvtriton-fleet-fidelity-") as scratch:
        workdir = Path(scratch)
        model_dir = TinyLlama().write(workdir / "llama")
        cluster = MooncakeCluster(workdir / "mooncake").start()
        try:
            comparisons = compare(
                setup, model_dir, workdir / "fleet", mooncake_master=cluster.master_address,
                pool_bytes=cluster.holder_bytes, progress=True,
            )  # fmt: skip
        finally:
            cluster.stop()
    distinct = distinct_blocks(workload(setup.tiered.engine), setup.block_size)
    print(
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d} with vLLM {installed_vllm_version()} on CPU.\n"
    )
    print(markdown(setup, comparisons, distinct))
    return 0


if __name__ == "__main__":
    sys.exit(main())
