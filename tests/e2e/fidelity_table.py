"""`kvtriton simulate`'s prediction against what a real vLLM engine with kvtriton reports, for the same trace.

One seeded workload (:func:`kvtriton.sim._token_trace.token_workload`: Zipf-popular
system prompts with unique tails, and multi-turn conversations resending their
history) is written as a trace in simulate's format and read back by the
simulator's parser; the same prompts go through a real vLLM 0.33 engine on CPU
(a tiny random Llama, :mod:`e2e.fidelity_engine`) with kvtriton's
``KVTritonOffloadingSpec``, the engine's prefix cache on and a small GPU KV
cache, one request at a time. Each point (host size, policy) compares vLLM's
offload hit rate, ``external_prefix_cache_hits / external_prefix_cache_queries``
from the engine's own counters, with
:func:`kvtriton.sim._vllm_server.predict` under the same settings
(``--gpu-blocks``, ``--max-num-seqs``, ``--sequential``, block size, slots).

Run as a command it prints the table docs/simulate.md shows::

    PYTHONPATH=.:tests .venv/bin/python -m e2e.fidelity_table [--all-at-once]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.tiny_models import HEAD_DIM, TinyLlama
from e2e.engine import HITS, run_process, spec_config
from kvtriton.sim._token_trace import TokenRequest, TokenWorkloadParams, block_hashes, token_workload, write_trace
from kvtriton.sim._vllm_server import DEFAULT_STORE_STEPS, ServerModel, ServerStats, predict
from kvtriton.sim._workloads import read_trace

ENGINES_AT_ONCE = 2
"""Fidelity engines run side by side (each in a process of its own)."""

QUERIES = "vllm:external_prefix_cache_queries"
LOCAL_HITS = "vllm:prefix_cache_hits"
BYTES_PER_ELEMENT = 4
"""The tiny model's KV cache is float32."""


@dataclass(frozen=True, slots=True)
class FidelitySetup:
    """The workload and the engine settings both sides use."""

    requests: int = 300
    seed: int = 0
    block_size: int = 32
    gpu_blocks: int = 40
    """vLLM's ``num_gpu_blocks`` (null block included): about half the prompt tokens are served by the engine's cache."""
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 1024
    max_model_len: int = 1024
    max_tokens: int = 1
    all_at_once: bool = False
    """Every request sent before the engine's first step (else one at a time, simulated with ``--sequential``)."""
    store_steps: int = 1
    """The simulator's ``--store-steps``: kvtriton's worker on CPU reports a store done at the end of the step
    that submits it, the one after the step that prepared it (with the default, 2, the gap is up to a point)."""
    host_shares: tuple[float, ...] = (0.1, 0.3)
    """Host sizes as shares of the trace's distinct blocks."""
    policies: tuple[str, ...] = ("lru", "arc")

    def server_model(self) -> ServerModel:
        """The simulator's settings for this engine: ``--gpu-blocks --max-num-seqs --sequential``."""
        return ServerModel(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            gpu_blocks=self.gpu_blocks,
            sequential=not self.all_at_once,
            output_tokens=self.max_tokens,
            store_steps=self.store_steps,
        )


@dataclass(frozen=True, slots=True)
class Measured:
    """What the real engine reported for one point."""

    hits: int
    queries: int
    local_hits: int
    cached_tokens: tuple[int, ...]
    """Per request, ``num_cached_tokens`` (engine prefix cache plus offload tier)."""
    run_s: float
    startup_s: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True, slots=True)
class Point:
    """One host size and policy: the prediction and the measurement."""

    slots: int
    share: float
    policy: str
    predicted: ServerStats
    measured: Measured

    @property
    def gap_points(self) -> float:
        """Measured minus predicted offload hit rate, in percentage points."""
        return 100.0 * (self.measured.hit_rate - self.predicted.external_hit_rate)

    @property
    def requests_agreeing(self) -> int:
        """Requests whose cached tokens (engine cache plus offload tier) are the ones predicted."""
        predicted = [outcome.gpu_hit_tokens + outcome.external_hit_tokens for outcome in self.predicted.outcomes]
        return sum(mine == theirs for mine, theirs in zip(predicted, self.measured.cached_tokens, strict=True))

    def describe(self) -> str:
        predicted, measured = self.predicted, self.measured
        return (
            f"{self.policy} at {self.slots} slots ({self.share:.0%} of the distinct blocks): vLLM reported"
            f" {measured.hits}/{measured.queries} = {100 * measured.hit_rate:.2f}%, simulate predicted"
            f" {predicted.external_hit_tokens}/{predicted.external_query_tokens} ="
            f" {100 * predicted.external_hit_rate:.2f}%, a gap of {self.gap_points:+.2f} points;"
            f" engine prefix-cache hits {measured.local_hits} measured, {predicted.gpu_hit_tokens} predicted;"
            f" {self.requests_agreeing} of {len(measured.cached_tokens)} requests agree on their cached tokens"
        )


def workload(setup: FidelitySetup) -> list[TokenRequest]:
    return token_workload(setup.seed, TokenWorkloadParams(requests=setup.requests))


def distinct_blocks(requests: Sequence[TokenRequest], block_size: int) -> int:
    return len({key for request in requests for key in block_hashes(request.prompt, block_size)})


def kv_bytes_per_block(model: TinyLlama, block_size: int) -> int:
    """The tiny model's KV bytes per block over all layers (keys and values): kvtriton's slot size."""
    return model.num_layers * 2 * model.num_kv_heads * HEAD_DIM * block_size * BYTES_PER_ELEMENT


def measure(
    model_dir: Path, requests: Sequence[TokenRequest], setup: FidelitySetup, *, slots: int, policy: str, workdir: Path
) -> Measured:
    """Run ``requests`` through a real engine whose kvtriton slab holds ``slots`` blocks under ``policy``."""
    slot_bytes = kv_bytes_per_block(TinyLlama(), setup.block_size)
    job = {
        "model": str(model_dir),
        "block_size": setup.block_size,
        "max_model_len": setup.max_model_len,
        "max_num_seqs": setup.max_num_seqs,
        "max_num_batched_tokens": setup.max_num_batched_tokens,
        "gpu_blocks": setup.gpu_blocks,
        "kv_cache_bytes": 16 << 20,
        "max_tokens": setup.max_tokens,
        "all_at_once": setup.all_at_once,
        "kv_transfer_config": spec_config(
            "KVTritonOffloadingSpec", cpu_bytes_to_use=slots * slot_bytes, eviction_policy=policy
        ),
        "prompts": [list(request.prompt) for request in requests],
    }
    raw, _ = run_process("e2e.fidelity_engine", job, workdir, label=f"the fidelity engine ({policy}, {slots} slots)")
    if raw["num_slots"] != slots or raw["kv_bytes_per_block"] != slot_bytes or raw["gpu_blocks"] != setup.gpu_blocks:
        raise AssertionError(
            f"the engine is not the one simulated: {raw['num_slots']} slots of {raw['kv_bytes_per_block']} bytes and"
            f" {raw['gpu_blocks']} GPU blocks, asked for {slots} slots of {slot_bytes} bytes and {setup.gpu_blocks}"
        )
    counters: dict[str, float] = raw["counters"]
    return Measured(
        hits=int(counters.get(HITS, 0.0)),
        queries=int(counters.get(QUERIES, 0.0)),
        local_hits=int(counters.get(LOCAL_HITS, 0.0)),
        cached_tokens=tuple(raw["cached_tokens"]),
        run_s=raw["run_s"],
        startup_s=raw["startup_s"],
    )


def compare(
    setup: FidelitySetup,
    model_dir: Path,
    workdir: Path,
    *,
    progress: bool = False,
    measured: dict[tuple[bool, int, str], Measured] | None = None,
) -> list[Point]:
    """Every (host size, policy) point of ``setup``: the trace written and simulated, the engine measured.

    ``measured`` (by arrival pattern, slots and policy) holds engine runs to
    reuse, and receives the new ones.
    """
    done = measured if measured is not None else {}
    requests = workload(setup)
    workdir.mkdir(parents=True, exist_ok=True)
    trace_path = write_trace(workdir / "trace.jsonl", requests, setup.block_size)
    trace = read_trace(trace_path, block_size=setup.block_size)
    distinct = distinct_blocks(requests, setup.block_size)
    grid = [
        (share, max(1, round(share * distinct)), policy) for share in setup.host_shares for policy in setup.policies
    ]
    started = time.monotonic()
    missing = {(setup.all_at_once, slots, policy) for _, slots, policy in grid} - done.keys()
    # Two engine processes at a time: an engine's start-up is mostly one core's work, and this machine has two.
    with ThreadPoolExecutor(max_workers=ENGINES_AT_ONCE) as pool:
        runs = {
            key: pool.submit(
                measure, model_dir, requests, setup, slots=key[1], policy=key[2], workdir=workdir / f"{key[2]}-{key[1]}"
            )
            for key in sorted(missing)
        }
        done.update({key: run.result() for key, run in runs.items()})
    points: list[Point] = []
    for share, slots, policy in grid:
        predicted = predict(trace, slots=slots, block_size=setup.block_size, policy=policy, model=setup.server_model())
        point = Point(slots, share, policy, predicted, done[(setup.all_at_once, slots, policy)])
        points.append(point)
        if progress:
            print(f"[{time.monotonic() - started:5.1f} s] {point.describe()}", file=sys.stderr, flush=True)
    return points


def simulate_flags(setup: FidelitySetup) -> str:
    """The ``kvtriton simulate`` flags that model ``setup``'s engine."""
    arrival = "" if setup.all_at_once else " --sequential"
    return (
        f"--block-size {setup.block_size} --gpu-blocks {setup.gpu_blocks} --max-num-seqs {setup.max_num_seqs}"
        f" --max-num-batched-tokens {setup.max_num_batched_tokens} --decode-steps {setup.max_tokens}{arrival}"
        f" --store-steps {setup.store_steps}"
    )


def markdown(runs: Sequence[tuple[FidelitySetup, Sequence[Point]]], distinct: int) -> str:
    """One table: a row per point, each run's arrival pattern and simulate flags named."""
    first = runs[0][0]
    lines = [
        f"{first.requests} requests (seed {first.seed}), {distinct} distinct blocks of {first.block_size} tokens;"
        f" engine: {first.gpu_blocks} GPU blocks with its prefix cache on, max_num_seqs {first.max_num_seqs},"
        f" max_tokens {first.max_tokens}.",
        "",
        "| requests sent | simulated with | host size | policy | predicted | measured (vLLM) | measured - predicted"
        " | engine cache hits (pred. / meas.) | requests agreeing |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for setup, points in runs:
        lines += [_row(setup, point) for point in points]
    return "\n".join(lines)


def _row(setup: FidelitySetup, point: Point) -> str:
    predicted, measured = point.predicted, point.measured
    sent = "all at once" if setup.all_at_once else "one at a time"
    return (
        f"| {sent} | `{simulate_flags(setup)}` | {point.slots} blocks ({point.share:.0%}) | {point.policy}"
        f" | {100 * predicted.external_hit_rate:.2f}% ({predicted.external_hit_tokens}/{predicted.external_query_tokens})"
        f" | {100 * measured.hit_rate:.2f}% ({measured.hits}/{measured.queries})"
        f" | {point.gap_points:+.2f} pt | {predicted.gpu_hit_tokens} / {measured.local_hits}"
        f" | {point.requests_agreeing} / {len(measured.cached_tokens)} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.fidelity_table",
        description="simulate's prediction against a real vLLM engine, as a markdown table",
    )
    default = FidelitySetup()
    parser.add_argument("--requests", type=int, default=default.requests, help="requests in the workload")
    parser.add_argument("--seed", type=int, default=default.seed, help="the workload's seed")
    parser.add_argument(
        "--all-at-once", action="store_true",
        help="also send every request at once (max_num_seqs admits them), simulated with both store timings",
    )  # fmt: skip
    args = parser.parse_args(argv)
    setups = [FidelitySetup(requests=args.requests, seed=args.seed)]
    if args.all_at_once:
        burst = dataclasses.replace(setups[0], all_at_once=True)
        setups += [burst, dataclasses.replace(burst, store_steps=DEFAULT_STORE_STEPS)]
    runs: list[tuple[FidelitySetup, Sequence[Point]]] = []
    with tempfile.TemporaryDirectory(prefix="kvtriton-fidelity-") as scratch:
        workdir = Path(scratch)
        model_dir = TinyLlama().write(workdir / "llama")
        measured: dict[tuple[bool, int, str], Measured] = {}
        for index, setup in enumerate(setups):
            # A setting that differs only in how it is simulated reuses the engine's measurements.
            points = compare(setup, model_dir, workdir / f"run{index}", progress=True, measured=measured)
            runs.append((setup, points))
    distinct = distinct_blocks(workload(setups[0]), setups[0].block_size)
    print(f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d} with vLLM 0.33.0 on CPU.\n")
    print(markdown(runs, distinct))
    return 0


if __name__ == "__main__":
    sys.exit(main())
