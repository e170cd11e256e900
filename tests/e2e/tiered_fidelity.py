"""`kvtriton simulate --tier fs|mooncake` against real vLLM engines with kvtriton's tiered spec, per arrival mode.

The seeded workload of :mod:`e2e.fidelity_table` (Zipf-popular system prompts
with unique tails, and conversations resending their history) is sent three
ways, as ``vllm bench serve`` would: one at a time, four in flight (the next
sent once one finished) and all at once. Each mode splits the trace into
consecutive runs; each run is a fresh engine (:mod:`e2e.tiered_fidelity_engine`:
one process per tier, an engine after the other) with
``KVTritonTieringOffloadingSpec``, a host tier smaller than the working set
and a second tier of the mode's own (vLLM's ``fs`` tier on a root directory,
or kvtriton's Mooncake Store tier in a namespace, on one pool): a restart
empties the host tier and the engine's own prefix cache, and keeps the tier.
The prediction replays each run's part of the trace through
:func:`kvtriton.sim._vllm_server.predict` with the engine's settings
(``--arrivals concurrency:1``, ``concurrency:4`` or ``burst``) and one tier
model carried from run to run. Each run compares, per tier:

* what each tier served: ``vllm:prompt_tokens_cached_by_source`` (``host``,
  and ``disk`` for fs or ``external_unspecified`` for Mooncake) over the
  queried tokens, the columns ``kvtriton simulate --tier`` prints as ``host
  hit`` and ``tier hit``;
* vLLM's first-lookup chunk counters,
  ``vllm:kv_offload_tiering_chunk_hits / _chunk_queries`` (``0:primary``, ``1:<tier>``);
* the combined ``external_prefix_cache_hits / _queries``.

Run as a command it prints the table docs/simulate.md shows (it starts its own Mooncake cluster)::

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
from typing import Any

from bench.tiny_models import TinyLlama
from e2e.engine import mooncake_tier, run_process, spec_config
from e2e.fidelity_table import HITS, LOCAL_HITS, QUERIES, FidelitySetup, distinct_blocks, kv_bytes_per_block, workload
from kvtriton._integrity import SEAL_BYTES
from kvtriton.integrations._vllm_release import installed_vllm_version
from kvtriton.integrations.vllm._surface import LOOKUPS_MARK_PRESENT
from kvtriton.sim._secondary_tier import FsTier, MooncakePool, SecondaryTier, TierCounts
from kvtriton.sim._token_trace import TokenRequest, write_trace
from kvtriton.sim._vllm_server import ServerModel, ServerStats, predict
from kvtriton.sim._workloads import read_trace
from kvtriton.worker import RegionLayout

CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"
CHUNK_QUERIES = "vllm:kv_offload_tiering_chunk_queries"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
HOST_TIER = "0:primary"
SECOND_TIER = "1:tier"
"""The second tier's first-lookup counters, whatever vLLM labels it (``1:fs``, ``1:MooncakeStoreTier``)."""
FROM_HOST = "from host"
FROM_TIER = "from tier"
COMBINED = "combined"
"""The combined external hit rate (tokens) vLLM reports over both tiers."""
RATES = (FROM_HOST, FROM_TIER, HOST_TIER, SECOND_TIER, COMBINED)
SOURCES = {"fs": "disk", "mooncake": "external_unspecified"}
"""The ``source`` label of a chunk loaded after its promotion from each tier (vLLM's CacheHitSource)."""
MODES: dict[str, int | None] = {"one at a time": 1, "concurrency 4": 4, "all at once": None}
"""Each arrival mode and its client's concurrency (None: every request before the first step)."""
ARRIVALS_FLAG = {"one at a time": "concurrency:1", "concurrency 4": "concurrency:4", "all at once": "burst"}


@dataclass(frozen=True, slots=True)
class TieredSetup:
    """The workload, its split into engine runs, the host tier's size and the arrival modes."""

    engine: FidelitySetup = dataclasses.field(default_factory=lambda: FidelitySetup(requests=160))
    runs: int = 2
    """Engine processes in turn on one tier, each serving the next part of the trace."""
    host_share: float = 0.2
    """The host tier as a share of the trace's distinct blocks."""
    modes: tuple[str, ...] = tuple(MODES)

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

    def server_model(self, mode: str) -> ServerModel:
        """The simulator's settings for the engine in ``mode``: ``--arrivals concurrency:N`` or ``burst``."""
        return dataclasses.replace(
            self.engine.server_model(),
            sequential=False,
            concurrency=MODES[mode],
            stores_mark_present=LOOKUPS_MARK_PRESENT,  # the rule of the vLLM the engines run
        )


@dataclass(frozen=True, slots=True)
class TierRates:
    """Hits and queries: one tier's chunks, or tokens (served by a source, or the combined external hits)."""

    hits: int
    queries: int

    @property
    def rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def describe(self) -> str:
        return f"{self.hits}/{self.queries} = {100 * self.rate:.2f}%"


@dataclass(frozen=True, slots=True)
class RunComparison:
    """One engine run of one tier and arrival mode: each rate, predicted and measured."""

    tier: str
    mode: str
    run: int
    requests: int
    slots: int
    predicted: dict[str, TierRates]
    measured: dict[str, TierRates]
    local_hits: tuple[int, int]
    """The engine's own prefix-cache hits: predicted, measured."""

    def gap_points(self, rate: str) -> float:
        return 100.0 * (self.measured[rate].rate - self.predicted[rate].rate)

    def describe(self) -> str:
        parts = [
            f"{rate}: vLLM reported {self.measured[rate].describe()}, simulate predicted"
            f" {self.predicted[rate].describe()}, a gap of {self.gap_points(rate):+.2f} points"
            for rate in self.measured
        ]
        return (
            f"{self.tier}, {self.mode}, run {self.run} ({self.requests} requests, {self.slots} host chunks): "
            + "; ".join(parts)
            + f"; engine prefix-cache hits {self.local_hits[1]} measured, {self.local_hits[0]} predicted"
        )


def predicted_rates(stats: ServerStats) -> dict[str, TierRates]:
    counts: TierCounts | None = stats.tiers
    if counts is None:
        raise ValueError("a tiered prediction has tier counts")
    queries = stats.external_query_tokens
    block_size = stats.external_hit_tokens // max(counts.host_loaded_chunks + counts.tier_loaded_chunks, 1)
    return {
        FROM_HOST: TierRates(counts.host_loaded_chunks * block_size, queries),
        FROM_TIER: TierRates(counts.tier_loaded_chunks * block_size, queries),
        HOST_TIER: TierRates(counts.host_chunk_hits, counts.host_chunk_queries),
        SECOND_TIER: TierRates(counts.tier_chunk_hits, counts.tier_chunk_queries),
        COMBINED: TierRates(stats.external_hit_tokens, queries),
    }


def tier_config(kind: str, mode: str, workdir: Path, mooncake_master: str | None) -> dict[str, object]:
    """The mode's own second tier: an fs root, or a namespace on the one Mooncake pool."""
    name = mode.replace(" ", "-")
    if kind == "fs":
        return {"type": "fs", "root_dir": str(workdir / f"fs-{name}")}
    if mooncake_master is None:
        raise ValueError("the Mooncake tier needs a master's address")
    return mooncake_tier(mooncake_master, f"fidelity-{name}-{workdir.name}")


def measure_runs(
    model_dir: Path,
    parts: Sequence[Sequence[TokenRequest]],
    setup: TieredSetup,
    kind: str,
    *,
    slots: int,
    workdir: Path,
    mooncake_master: str | None = None,
) -> dict[str, list[tuple[dict[str, TierRates], int]]]:
    """Per mode, each part on a fresh engine in turn on the mode's tier, all in one process: each rate as vLLM's
    counters report it, and the engine's own prefix-cache hits."""
    engine = setup.engine
    slot_bytes = kv_bytes_per_block(TinyLlama(), engine.block_size)
    host_bytes = slots * RegionLayout.block_row_stride_for(1, 1, slot_bytes)
    runs: list[dict[str, object]] = [
        {
            "prompts": [list(request.prompt) for request in part],
            "concurrency": MODES[mode] or len(part),
            "kv_transfer_config": spec_config(
                "KVTritonTieringOffloadingSpec",
                cpu_bytes_to_use=host_bytes,
                eviction_policy="lru",
                secondary_tiers=[tier_config(kind, mode, workdir, mooncake_master)],
            ),
        }
        for mode in setup.modes
        for part in parts
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
    raw, _ = run_process("e2e.tiered_fidelity_engine", job, workdir, label=f"the tiered fidelity engines ({kind})")
    results: list[dict[str, Any]] = raw["runs"]
    measured: dict[str, list[tuple[dict[str, TierRates], int]]] = {mode: [] for mode in setup.modes}
    for index, run in enumerate(results):
        if run["num_slots"] != slots or run["gpu_blocks"] != engine.gpu_blocks:
            raise AssertionError(
                f"the engine is not the one simulated: {run['num_slots']} host chunks and {run['gpu_blocks']} GPU"
                f" blocks, asked for {slots} and {engine.gpu_blocks}"
            )
        measured[setup.modes[index // len(parts)]].append(
            (_measured_rates(run, kind), int(run["counters"].get(LOCAL_HITS, 0.0)))
        )
    return measured


def _measured_rates(run: dict[str, Any], kind: str) -> dict[str, TierRates]:
    counters: dict[str, float] = run["counters"]
    by_label: dict[str, dict[str, float]] = run["tier_counters"]
    queries = int(counters.get(QUERIES, 0.0))
    sources = by_label.get(CACHED_BY_SOURCE, {})
    hits, chunk_queries = by_label.get(CHUNK_HITS, {}), by_label.get(CHUNK_QUERIES, {})
    second = next((label for label in chunk_queries if label.startswith("1:")), SECOND_TIER)
    return {
        FROM_HOST: TierRates(int(sources.get("host", 0.0)), queries),
        FROM_TIER: TierRates(int(sources.get(SOURCES[kind], 0.0)), queries),
        HOST_TIER: TierRates(int(hits.get(HOST_TIER, 0.0)), int(chunk_queries.get(HOST_TIER, 0.0))),
        SECOND_TIER: TierRates(int(hits.get(second, 0.0)), int(chunk_queries.get(second, 0.0))),
        COMBINED: TierRates(int(counters.get(HITS, 0.0)), queries),
    }


def tier_model(kind: str, pool_bytes: int, chunk_bytes: int) -> SecondaryTier:
    """A fresh model of the tier: fs, or a Mooncake pool of ``pool_bytes`` holding chunks and their seals."""
    return FsTier() if kind == "fs" else MooncakePool(pool_bytes // (chunk_bytes + SEAL_BYTES))


def compare(
    setup: TieredSetup,
    model_dir: Path,
    workdir: Path,
    kind: str,
    *,
    mooncake_master: str | None = None,
    pool_bytes: int = 0,
    progress: bool = False,
) -> list[RunComparison]:
    """Every mode and run of ``setup`` on ``kind``'s tier, against the prediction with the tier carried alike."""
    requests = workload(setup.engine)
    block_size = setup.engine.block_size
    slots = setup.host_slots(requests)
    parts = setup.parts(requests)
    workdir.mkdir(parents=True, exist_ok=True)
    measured = measure_runs(
        model_dir, parts, setup, kind, slots=slots, workdir=workdir, mooncake_master=mooncake_master
    )
    chunk_bytes = RegionLayout.block_row_stride_for(1, 1, kv_bytes_per_block(TinyLlama(), block_size))
    comparisons: list[RunComparison] = []
    for mode in setup.modes:
        tier = tier_model(kind, pool_bytes, chunk_bytes)
        for index, (part, (rates, local_hits)) in enumerate(zip(parts, measured[mode], strict=True), start=1):
            trace_path = write_trace(workdir / f"trace-run{index}.jsonl", part, block_size)
            predicted = predict(
                read_trace(trace_path, block_size=block_size),
                slots=slots, block_size=block_size, policy="lru", model=setup.server_model(mode), tier=tier,
            )  # fmt: skip
            comparison = RunComparison(
                kind, mode, index, len(part), slots, predicted_rates(predicted), rates,
                (predicted.gpu_hit_tokens, local_hits),
            )  # fmt: skip
            comparisons.append(comparison)
            if progress:
                print(comparison.describe(), file=sys.stderr, flush=True)
    return comparisons


def simulate_command(setup: TieredSetup, kind: str, mode: str) -> str:
    """The ``kvtriton simulate`` flags of one run's engine (the restarts are the harness's: one replay per run)."""
    engine = setup.engine
    return (
        f"--tier {kind} --policies lru --block-size {engine.block_size} --gpu-blocks {engine.gpu_blocks}"
        f" --max-num-seqs {engine.max_num_seqs} --max-num-batched-tokens {engine.max_num_batched_tokens}"
        f" --decode-steps {engine.max_tokens} --arrivals {ARRIVALS_FLAG[mode]} --store-steps {engine.store_steps}"
    )


NAMES = {
    FROM_HOST: "host hit (`prompt_tokens_cached_by_source` host)",
    FROM_TIER: "tier hit (its source)",
    HOST_TIER: "`0:primary` first-lookup chunk hits",
    SECOND_TIER: "`1:<tier>` first-lookup chunk hits",
    COMBINED: "combined (external hits)",
}


def markdown(setup: TieredSetup, comparisons: Sequence[RunComparison], distinct: int) -> str:
    engine = setup.engine
    lines = [
        f"{engine.requests} requests (seed {engine.seed}) in {setup.runs} engine runs per mode on one tier (each"
        f" mode its own fs root or Mooncake namespace), {distinct} distinct blocks of {engine.block_size} tokens;"
        f" host tier {comparisons[0].slots} chunks (LRU); engine: {engine.gpu_blocks} GPU blocks with its prefix"
        f" cache on, max_num_seqs {engine.max_num_seqs}. Simulated with `{simulate_command(setup, 'fs', 'concurrency 4')}`"
        " (the tier and `--arrivals` as the row says), the tier carried from run to run.",
        "",
        "| tier | requests sent | run | rate | predicted | measured (vLLM) | measured - predicted |",
        "|---|---|---|---|---|---|---|",
    ]
    for comparison in comparisons:
        for rate, name in NAMES.items():
            lines.append(
                f"| {comparison.tier} | {comparison.mode} | {comparison.run} | {name}"
                f" | {comparison.predicted[rate].describe()} | {comparison.measured[rate].describe()}"
                f" | {comparison.gap_points(rate):+.2f} pt |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.tiered_fidelity",
        description="simulate --tier fs|mooncake against real vLLM engines per arrival mode, as markdown",
    )
    default = TieredSetup()
    parser.add_argument("--requests", type=int, default=default.engine.requests, help="requests in the workload")
    parser.add_argument("--runs", type=int, default=default.runs, help="engine runs (restarts) per mode on one tier")
    parser.add_argument("--tiers", default="fs,mooncake", help="comma-separated: fs, mooncake (default: both)")
    args = parser.parse_args(argv)
    setup = TieredSetup(engine=dataclasses.replace(default.engine, requests=args.requests), runs=args.runs)
    comparisons: list[RunComparison] = []
    with tempfile.TemporaryDirectory(prefix="kvtriton-tiered-fidelity-") as scratch:
        workdir = Path(scratch)
        model_dir = TinyLlama().write(workdir / "llama")
        for kind in args.tiers.split(","):
            if kind == "mooncake":
                from kvtriton.integrations._mooncake_local import MooncakeCluster

                cluster = MooncakeCluster(workdir / "mooncake").start()
                try:
                    comparisons += compare(
                        setup, model_dir, workdir / kind, kind, mooncake_master=cluster.master_address,
                        pool_bytes=cluster.holder_bytes, progress=True,
                    )  # fmt: skip
                finally:
                    cluster.stop()
            else:
                comparisons += compare(setup, model_dir, workdir / kind, kind, progress=True)
    distinct = distinct_blocks(workload(setup.engine), setup.engine.block_size)
    print(
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d} with vLLM {installed_vllm_version()} on CPU.\n"
    )
    print(markdown(setup, comparisons, distinct))
    return 0


if __name__ == "__main__":
    sys.exit(main())
