"""`kvtriton simulate --tier fs` against real vLLM engines with kvtriton's tiered spec and vLLM's fs tier, across restarts.

The seeded workload of :mod:`e2e.fidelity_table` (Zipf-popular system prompts
with unique tails, and conversations resending their history) is split into
consecutive runs; each run is a fresh engine (:mod:`e2e.tiered_fidelity_engine`:
one process, an engine after the other) with ``KVTritonTieringOffloadingSpec``, a host tier smaller than the working
set and vLLM's ``fs`` tier on one root directory for all runs: a restart
empties the host tier and the engine's own prefix cache, and keeps the disk.
Requests are sent one at a time. The prediction replays each run's part of the
trace through :func:`kvtriton.sim._vllm_server.predict` with the engine's
settings and one :class:`~kvtriton.sim._secondary_tier.FsTier` carried from run
to run. Each run compares, per tier, vLLM's
``vllm:kv_offload_tiering_chunk_hits / _chunk_queries`` (``0:primary`` and
``1:fs``) and the combined ``external_prefix_cache_hits / _queries``.

Run as a command it prints the table docs/simulate.md shows::

    PYTHONPATH=.:tests .venv/bin/python -m e2e.tiered_fidelity
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

from bench.tiny_models import TinyLlama
from e2e.engine import run_process, spec_config
from e2e.fidelity_table import HITS, LOCAL_HITS, QUERIES, FidelitySetup, distinct_blocks, kv_bytes_per_block, workload
from kvtriton.sim._secondary_tier import FsTier, TierCounts
from kvtriton.sim._token_trace import TokenRequest, write_trace
from kvtriton.sim._vllm_server import ServerStats, predict
from kvtriton.sim._workloads import read_trace
from kvtriton.worker import RegionLayout

CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"
CHUNK_QUERIES = "vllm:kv_offload_tiering_chunk_queries"
HOST_TIER = "0:primary"
FS_TIER = "1:fs"


@dataclass(frozen=True, slots=True)
class TieredSetup:
    """The workload, its split into engine runs, and the host tier's size."""

    engine: FidelitySetup = dataclasses.field(default_factory=lambda: FidelitySetup(requests=160))
    runs: int = 2
    """Engine processes in turn on one fs root, each serving the next part of the trace."""
    host_share: float = 0.2
    """The host tier as a share of the trace's distinct blocks."""

    def host_slots(self, requests: Sequence[TokenRequest]) -> int:
        """The host tier's chunks: ``host_share`` of the distinct blocks, never fewer than a prompt needs twice.

        A prompt longer than the host tier can never be promoted whole (each
        promotion evicts what the last one brought in), so vLLM would stall on it.
        """
        block_size = self.engine.block_size
        longest = max(len(request.prompt) // block_size for request in requests)
        return max(round(self.host_share * distinct_blocks(requests, block_size)), 2 * longest)

    def parts(self, requests: Sequence[TokenRequest]) -> list[Sequence[TokenRequest]]:
        size = -(-len(requests) // self.runs)
        return [requests[start : start + size] for start in range(0, len(requests), size)]


@dataclass(frozen=True, slots=True)
class TierRates:
    """One tier's chunk hits and queries, or the combined external hits and queries (tokens)."""

    hits: int
    queries: int

    @property
    def rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def describe(self) -> str:
        return f"{self.hits}/{self.queries} = {100 * self.rate:.2f}%"


@dataclass(frozen=True, slots=True)
class RunComparison:
    """One engine run: each tier's rate, predicted and measured."""

    run: int
    requests: int
    slots: int
    predicted: dict[str, TierRates]
    measured: dict[str, TierRates]
    local_hits: tuple[int, int]
    """The engine's own prefix-cache hits: predicted, measured."""

    def gap_points(self, tier: str) -> float:
        return 100.0 * (self.measured[tier].rate - self.predicted[tier].rate)

    def describe(self) -> str:
        parts = [
            f"{tier}: vLLM reported {self.measured[tier].describe()}, simulate predicted"
            f" {self.predicted[tier].describe()}, a gap of {self.gap_points(tier):+.2f} points"
            for tier in self.measured
        ]
        return (
            f"run {self.run} ({self.requests} requests, {self.slots} host chunks): " + "; ".join(parts)
            + f"; engine prefix-cache hits {self.local_hits[1]} measured, {self.local_hits[0]} predicted"
        )  # fmt: skip


COMBINED = "combined"
"""The combined external hit rate (tokens) vLLM reports over both tiers."""


def predicted_rates(stats: ServerStats) -> dict[str, TierRates]:
    counts: TierCounts | None = stats.tiers
    if counts is None:
        raise ValueError("a tiered prediction has tier counts")
    return {
        HOST_TIER: TierRates(counts.host_chunk_hits, counts.host_chunk_queries),
        FS_TIER: TierRates(counts.tier_chunk_hits, counts.tier_chunk_queries),
        COMBINED: TierRates(stats.external_hit_tokens, stats.external_query_tokens),
    }


def measure_runs(
    model_dir: Path, parts: Sequence[Sequence[TokenRequest]], setup: TieredSetup, *, slots: int, workdir: Path
) -> list[tuple[dict[str, TierRates], int]]:
    """Each part on a fresh engine, in turn, on one fs root: each tier's rates as its counters report them, and the
    engine's own prefix-cache hits."""
    engine = setup.engine
    slot_bytes = kv_bytes_per_block(TinyLlama(), engine.block_size)
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
        "kv_transfer_config": spec_config(
            "KVTritonTieringOffloadingSpec",
            cpu_bytes_to_use=slots * RegionLayout.block_row_stride_for(1, 1, slot_bytes),
            eviction_policy="lru",
            secondary_tiers=[{"type": "fs", "root_dir": str(workdir / "fs-root")}],
        ),
        "runs": [[list(request.prompt) for request in part] for part in parts],
    }
    raw, _ = run_process("e2e.tiered_fidelity_engine", job, workdir, label="the tiered fidelity engines")
    measured: list[tuple[dict[str, TierRates], int]] = []
    for run in raw["runs"]:
        if run["num_slots"] != slots or run["gpu_blocks"] != engine.gpu_blocks:
            raise AssertionError(
                f"the engine is not the one simulated: {run['num_slots']} host chunks and {run['gpu_blocks']} GPU"
                f" blocks, asked for {slots} and {engine.gpu_blocks}"
            )
        counters: dict[str, float] = run["counters"]
        by_tier: dict[str, dict[str, float]] = run["tier_counters"]

        def tier(label: str, by_tier: dict[str, dict[str, float]] = by_tier) -> TierRates:
            return TierRates(
                int(by_tier.get(CHUNK_HITS, {}).get(label, 0.0)), int(by_tier.get(CHUNK_QUERIES, {}).get(label, 0.0))
            )

        rates = {
            HOST_TIER: tier(HOST_TIER),
            FS_TIER: tier(FS_TIER),
            COMBINED: TierRates(int(counters.get(HITS, 0.0)), int(counters.get(QUERIES, 0.0))),
        }
        measured.append((rates, int(counters.get(LOCAL_HITS, 0.0))))
    return measured


def compare(setup: TieredSetup, model_dir: Path, workdir: Path, *, progress: bool = False) -> list[RunComparison]:
    """Every run of ``setup``, one engine after the other on one fs root, against the prediction carried alike."""
    requests = workload(setup.engine)
    block_size = setup.engine.block_size
    slots = setup.host_slots(requests)
    parts = setup.parts(requests)
    workdir.mkdir(parents=True, exist_ok=True)
    measured = measure_runs(model_dir, parts, setup, slots=slots, workdir=workdir)
    disk = FsTier()
    comparisons: list[RunComparison] = []
    for index, (part, (rates, local_hits)) in enumerate(zip(parts, measured, strict=True), start=1):
        trace_path = write_trace(workdir / f"trace-run{index}.jsonl", part, block_size)
        predicted = predict(
            read_trace(trace_path, block_size=block_size),
            slots=slots, block_size=block_size, policy="lru", model=setup.engine.server_model(), tier=disk,
        )  # fmt: skip
        comparison = RunComparison(
            index, len(part), slots, predicted_rates(predicted), rates, (predicted.gpu_hit_tokens, local_hits)
        )
        comparisons.append(comparison)
        if progress:
            print(comparison.describe(), file=sys.stderr, flush=True)
    return comparisons


def simulate_command(setup: TieredSetup) -> str:
    """The ``kvtriton simulate`` flags of one run's engine (the restarts are the harness's: one replay per run)."""
    engine = setup.engine
    return (
        f"--tier fs --policies lru --block-size {engine.block_size} --gpu-blocks {engine.gpu_blocks}"
        f" --max-num-seqs {engine.max_num_seqs} --max-num-batched-tokens {engine.max_num_batched_tokens}"
        f" --decode-steps {engine.max_tokens} --sequential --store-steps {engine.store_steps}"
    )


def markdown(setup: TieredSetup, comparisons: Sequence[RunComparison], distinct: int) -> str:
    engine = setup.engine
    lines = [
        f"{engine.requests} requests (seed {engine.seed}) in {setup.runs} engine runs on one fs root, {distinct}"
        f" distinct blocks of {engine.block_size} tokens; host tier {comparisons[0].slots} chunks (LRU); engine:"
        f" {engine.gpu_blocks} GPU blocks with its prefix cache on, one request at a time. Simulated with"
        f" `{simulate_command(setup)}`, the fs tier carried from run to run.",
        "",
        "| run | tier | predicted | measured (vLLM) | measured - predicted |",
        "|---|---|---|---|---|",
    ]
    names = {
        HOST_TIER: "host (`0:primary` chunk hits)",
        FS_TIER: "fs (`1:fs` chunk hits)",
        COMBINED: "combined (external hits)",
    }
    for comparison in comparisons:
        for tier, name in names.items():
            lines.append(
                f"| {comparison.run} | {name} | {comparison.predicted[tier].describe()}"
                f" | {comparison.measured[tier].describe()} | {comparison.gap_points(tier):+.2f} pt |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.tiered_fidelity", description="simulate --tier fs against real vLLM engines, as markdown"
    )
    default = TieredSetup()
    parser.add_argument("--requests", type=int, default=default.engine.requests, help="requests in the workload")
    parser.add_argument("--runs", type=int, default=default.runs, help="engine runs (restarts) on one fs root")
    args = parser.parse_args(argv)
    setup = TieredSetup(engine=dataclasses.replace(default.engine, requests=args.requests), runs=args.runs)
    with tempfile.TemporaryDirectory(prefix="kvtriton-tiered-fidelity-") as scratch:
        workdir = Path(scratch)
        model_dir = TinyLlama().write(workdir / "llama")
        comparisons = compare(setup, model_dir, workdir, progress=True)
    distinct = distinct_blocks(workload(setup.engine), setup.engine.block_size)
    print(f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d} with vLLM 0.33.0 on CPU.\n")
    print(markdown(setup, comparisons, distinct))
    return 0


if __name__ == "__main__":
    sys.exit(main())
