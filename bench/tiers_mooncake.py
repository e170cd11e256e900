"""Mooncake tier throughput and promotion latency on loopback TCP, next to vLLM's fs tier and raw Mooncake calls.

For each chunk size (0.5, 2 and 4 MiB by default) the same primary memory is
cascaded (stored) and promoted (loaded) through three paths in one run:

* ``mooncake``: :class:`kvtriton.integrations.mooncake.MooncakeStoreTier`'s own calls
  (submit_store / submit_load / get_finished_jobs), jobs of ``--chunks-per-job``
  chunks all submitted at once, as vLLM's tiering manager does;
* ``raw``: the same ``batch_put_from`` / ``batch_get_into`` calls on the same
  chunks with the same number of threads, straight on a Mooncake client: the
  tier's overhead is ``mooncake / raw`` (goal: at least 0.8);
* ``fs``: vLLM's ``FileSystemTierManager`` on a temporary directory;
* ``mooncake_encrypted``: the ``mooncake`` path behind a spec with
  ``kvtriton_encryption`` (a random master key for the run): every chunk
  sealed for its tenant (AES-256-GCM) on the tier's I/O threads into a
  buffer of the job's own, every load opened from one; encryption's cost is
  ``mooncake_encrypted / mooncake`` (issue 48: the serving goal is within 5 %,
  this is the tier's own throughput).

Promotion latency is measured the way the scheduler sees it: from the first
lookup of a chunk, one scheduler step every ``--step-ms`` (a lookup, then the
step's end), until the chunk's load job has finished; in steps and ms.

A master and a storage holder are started on 127.0.0.1 for the run
(kvtriton/integrations/_mooncake_local.py) and stopped after it. Every promoted chunk
is compared with the bytes cascaded. JSON under bench/results/.

Mooncake's client library logs about a hundred lines per run to stderr; they
go to a file, and one line names it with its line and error counts
(``--mooncake-log`` shows them instead). ``--quick`` is a smoke run: 16 MiB
per size, one repeat, no goal verdict, written as ``tiers_mooncake-quick.json``.
"""

from __future__ import annotations

import argparse
import copy
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from bench.common import bench_parser, format_table, offloading_config, write_json
from bench.third_party_logs import native_log_captured, quiet_vllm
from kvtriton.encryption import MasterKey
from kvtriton.integrations import MooncakeCluster, mooncake_missing
from kvtriton.integrations.mooncake import MooncakeStoreTier, MooncakeTierConfig, open_store
from kvtriton.integrations.vllm import RequestTenant, TierEncryption

MIB = 1024 * 1024
DEFAULT_CHUNK_MIB = (0.5, 2.0, 4.0)
OVERHEAD_GOAL = 0.8
"""The tier's time may be at most 1 / 0.8 of the raw calls' on the same chunks (raw time / tier time >= 0.8)."""


class _Tier(Protocol):
    """The job half of vLLM's SecondaryTierManager, shared by the Mooncake and fs tiers."""

    def submit_store(self, job_metadata: TransferJob) -> None: ...
    def submit_load(self, job_metadata: TransferJob) -> None: ...
    def get_finished_jobs(self) -> Iterable[JobResult]: ...


@dataclass(frozen=True)
class SizeResult:
    chunk_mib: float
    chunks: int
    mooncake_store_gbps: float
    mooncake_load_gbps: float
    raw_store_gbps: float
    raw_load_gbps: float
    fs_store_gbps: float
    fs_load_gbps: float
    mooncake_encrypted_store_gbps: float
    mooncake_encrypted_load_gbps: float
    store_overhead_ratio: float
    """mooncake / raw for stores (1.0: the tier adds nothing)."""
    load_overhead_ratio: float
    promotion_steps: float
    """Median scheduler steps from the first lookup to the loaded chunk."""
    promotion_ms: float
    """Median milliseconds from the first lookup to the loaded chunk."""

    @property
    def encrypted_store_ratio(self) -> float:
        """Stores sealed for their tenant against stores in the clear, through the same tier (1.0: free)."""
        return self.mooncake_encrypted_store_gbps / self.mooncake_store_gbps

    @property
    def encrypted_load_ratio(self) -> float:
        return self.mooncake_encrypted_load_gbps / self.mooncake_load_gbps


def gbps(total_bytes: int, seconds: float) -> float:
    return total_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("tiers_mooncake", __doc__)
    parser.add_argument(
        "--chunk-mib",
        type=float,
        nargs="+",
        default=list(DEFAULT_CHUNK_MIB),
        help="chunk sizes in MiB (default 0.5 2 4)",
    )
    parser.add_argument(
        "--total-mib", type=int, help="bytes moved per size and direction, in MiB (default 256; 16 with --quick)"
    )
    parser.add_argument("--chunks-per-job", type=int, default=8, help="chunks per store/load job (default %(default)s)")
    parser.add_argument(
        "--io-threads",
        type=int,
        default=4,
        help="the tier's io_threads and the raw path's threads (default %(default)s)",
    )
    parser.add_argument("--repeats", type=int, help="runs per path; the fastest counts (default 3; 1 with --quick)")
    parser.add_argument(
        "--promotions", type=int, default=5, help="single-chunk promotions timed per size (default %(default)s)"
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=5.0,
        help="scheduler step period for the promotion latency (default %(default)s)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 16 MiB per size and one repeat, no goal verdict; writes tiers_mooncake-quick.json",
    )
    parser.add_argument(
        "--name",
        help="result file name under bench/results/ (default tiers_mooncake, tiers_mooncake-quick with --quick)",
    )
    parser.add_argument(
        "--mooncake-log",
        action="store_true",
        help="show the Mooncake client library's own log on stderr instead of summarising it in one line",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_vllm()
    quick: bool = args.quick
    name: str = args.name if args.name is not None else "tiers_mooncake-quick" if quick else "tiers_mooncake"
    total_mib: int = args.total_mib if args.total_mib is not None else 16 if quick else 256
    repeats: int = args.repeats if args.repeats is not None else 1 if quick else 3
    chunk_sizes: list[float] = args.chunk_mib
    per_job: int = args.chunks_per_job
    threads: int = args.io_threads
    if total_mib < 1 or repeats < 1 or per_job < 1 or threads < 1 or any(size <= 0 for size in chunk_sizes):
        raise SystemExit(
            f"need --total-mib, --repeats, --chunks-per-job, --io-threads >= 1 and --chunk-mib > 0;"
            f" got {total_mib}, {repeats}, {per_job}, {threads}, {chunk_sizes}"
        )
    missing = mooncake_missing()
    if missing is not None:
        print(f"skipped: {missing}")
        return 0
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    workdir = Path(tempfile.mkdtemp(prefix="kvtriton-bench-mooncake-"))
    # Two copies of every size's data may live in the pool at once (tier and raw runs), plus slack.
    cluster = MooncakeCluster(workdir / "logs", holder_bytes=(3 * total_mib + 64) * MIB)
    results: list[SizeResult] = []
    log_folder = Path(tempfile.mkdtemp(prefix="kvtriton-bench-mooncake-log-"))
    try:
        cluster.start()
        print(f"mooncake master {cluster.master_address}, holder {3 * total_mib + 64} MiB", flush=True)
        with native_log_captured(log_folder, enabled=not args.mooncake_log) as native_log:
            for size in chunk_sizes:
                print(f"chunk {size} MiB ...", flush=True)
                results.append(
                    measure_size(
                        cluster.master_address,
                        workdir,
                        size,
                        total_mib,
                        per_job,
                        threads,
                        repeats,
                        args.promotions,
                        args.step_ms,
                    )
                )
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    if not args.mooncake_log:
        print(native_log.summary("the Mooncake client library") + " (--mooncake-log shows it as it comes)")

    headers = [
        "chunk MiB",
        "chunks",
        "store GB/s",
        "raw store",
        "fs store",
        "load GB/s",
        "raw load",
        "fs load",
        "store ratio",
        "load ratio",
        "sealed store",
        "sealed load",
        "promo steps",
        "promo ms",
    ]
    rows = [
        [
            r.chunk_mib,
            r.chunks,
            r.mooncake_store_gbps,
            r.raw_store_gbps,
            r.fs_store_gbps,
            r.mooncake_load_gbps,
            r.raw_load_gbps,
            r.fs_load_gbps,
            r.store_overhead_ratio,
            r.load_overhead_ratio,
            r.encrypted_store_ratio,
            r.encrypted_load_ratio,
            r.promotion_steps,
            r.promotion_ms,
        ]
        for r in results
    ]
    print(format_table(headers, rows))
    worst = min(min(r.store_overhead_ratio, r.load_overhead_ratio) for r in results)
    if quick:
        print(f"smoke run (--quick, {total_mib} MiB, {repeats} repeat): no verdict on the goal >= {OVERHEAD_GOAL}")
    else:
        print(
            f"worst tier/raw ratio {worst:.3f}: goal >= {OVERHEAD_GOAL} {'met' if worst >= OVERHEAD_GOAL else 'NOT met'}"
        )
    path = write_json(
        name,
        {
            "benchmark": "tiers_mooncake",
            "smoke_run": quick,
            "goal_met": None if quick else worst >= OVERHEAD_GOAL,
            "transport": "tcp over 127.0.0.1 (one master, one holder, this process as the client)",
            "total_mib_per_size": total_mib,
            "chunks_per_job": per_job,
            "io_threads": threads,
            "repeats": repeats,
            "step_ms": args.step_ms,
            "overhead_goal": OVERHEAD_GOAL,
            "results": [asdict(result) for result in results],
        },
    )
    print(f"wrote {path}")
    return 0


def measure_size(
    master: str,
    workdir: Path,
    chunk_mib: float,
    total_mib: int,
    per_job: int,
    threads: int,
    repeats: int,
    promotions: int,
    step_ms: float,
) -> SizeResult:
    chunk_bytes = int(chunk_mib * MIB) // 4096 * 4096
    chunks = max(per_job, total_mib * MIB // chunk_bytes) // per_job * per_job
    # Rows [0, chunks) hold the source data; rows [chunks, 2 * chunks) receive the loads.
    # Page-aligned like vLLM's primary (an mmap region): the fs tier reads and writes it with O_DIRECT.
    region = mmap.mmap(-1, 2 * chunks * chunk_bytes)
    rows = np.ndarray((2 * chunks, chunk_bytes), dtype=np.uint8, buffer=region)
    rows[chunks:] = 0  # fault the load rows in now, or the first path to write them pays for it
    rows[:chunks] = np.random.default_rng(int(chunk_mib * 16)).integers(0, 256, (chunks, chunk_bytes), dtype=np.uint8)
    view: memoryview = rows.data
    # A one-group model whose chunk is chunk_bytes: what the tiers' namespace is built from.
    spec = CPUOffloadingSpec(
        offloading_config(
            {"cpu_bytes_to_use": 2 * chunk_bytes},
            worker_kv_bytes_per_block=chunk_bytes,
            engine_id="bench-tiers-mooncake",
            model_name="bench",
        )
    )
    context = ReqContext(req_id="bench")
    context.set_state(RequestTenant("bench-tenant"))  # as vLLM's connector records it; the encrypting tier needs it
    job_ids = iter(range(1, 1 << 62))
    run_ids = iter(range(1 << 30))

    def keys_for(run: int) -> list[OffloadKey]:
        return [make_offload_key(run.to_bytes(4, "big") + index.to_bytes(28, "big"), 0) for index in range(chunks)]

    def run_jobs(tier: _Tier, keys: list[OffloadKey], first_row: int, load: bool) -> float:
        jobs: set[int] = set()
        started = time.perf_counter()
        for start in range(0, chunks, per_job):
            job_id = next(job_ids)
            jobs.add(job_id)
            job = TransferJob(
                job_id,
                keys[start : start + per_job],
                np.arange(first_row + start, first_row + start + per_job),
                load,
                context,
            )
            (tier.submit_load if load else tier.submit_store)(job)
        failed: list[int] = []
        while jobs:
            for result in tier.get_finished_jobs():
                jobs.discard(result.job_id)
                if not result.success:
                    failed.append(result.job_id)
            time.sleep(0.0002)
        seconds = time.perf_counter() - started
        if failed:
            raise RuntimeError(f"{len(failed)} {'load' if load else 'store'} jobs failed at {chunk_mib} MiB chunks")
        return seconds

    def check_loaded() -> None:
        if not np.array_equal(rows[chunks:], rows[:chunks]):
            raise RuntimeError(f"promoted chunks differ from the cascaded ones at {chunk_mib} MiB")
        rows[chunks:] = 0

    total = chunks * chunk_bytes

    def mooncake_tier(tier_spec: CPUOffloadingSpec) -> MooncakeStoreTier:
        return MooncakeStoreTier(
            tier_spec,
            view,
            "MooncakeStoreTier",
            master_server_address=master,
            namespace="bench",
            io_threads=threads,
            timeout_s=30.0,
        )

    tier = mooncake_tier(spec)
    encrypting_spec = copy.copy(spec)
    setattr(encrypting_spec, "encryption", TierEncryption(MasterKey(os.urandom(32), source="a random key of the run")))
    encrypted_tier = mooncake_tier(encrypting_spec)
    store = open_store(MooncakeTierConfig(master_server_address=master, timeout_s=30.0))
    if store is None or not tier.wait_until_up(30.0) or not encrypted_tier.wait_until_up(30.0):
        raise RuntimeError(f"could not reach the Mooncake master at {master}")
    base = rows.ctypes.data
    if store.register_buffer(base, rows.nbytes) != 0:
        raise RuntimeError("registering the benchmark's memory with the raw client failed")
    pool = ThreadPoolExecutor(threads)
    fs_root = workdir / f"fs-{chunk_mib}"
    fs_tier = FileSystemTierManager(
        spec, view, "fs", root_dir=str(fs_root), n_read_threads=threads, n_write_threads=threads
    )
    try:

        def jobs_run(
            jobs_tier: _Tier, clean_up: Callable[[list[OffloadKey]], object]
        ) -> Callable[[], tuple[float, float]]:
            """A run of store then load jobs through ``jobs_tier`` over fresh keys, checked, then ``clean_up``."""

            def run() -> tuple[float, float]:
                keys = keys_for(next(run_ids))
                store_s = run_jobs(jobs_tier, keys, 0, load=False)
                load_s = run_jobs(jobs_tier, keys, chunks, load=True)
                check_loaded()
                clean_up(keys)
                return store_s, load_s

            return run

        def raw_run() -> tuple[float, float]:
            names = [f"raw/{next(run_ids)}/{index}" for index in range(chunks)]
            batches = [range(start, start + per_job) for start in range(0, chunks, per_job)]
            sizes = [chunk_bytes] * per_job

            def put(batch: range) -> list[int]:
                return store.batch_put_from([names[i] for i in batch], [base + i * chunk_bytes for i in batch], sizes)

            def get(batch: range) -> list[int]:
                return store.batch_get_into(
                    [names[i] for i in batch], [base + (chunks + i) * chunk_bytes for i in batch], sizes
                )

            started = time.perf_counter()
            put_codes = [code for codes in pool.map(put, batches) for code in codes]
            store_s = time.perf_counter() - started
            started = time.perf_counter()
            get_codes = [code for codes in pool.map(get, batches) for code in codes]
            load_s = time.perf_counter() - started
            if any(code != 0 for code in put_codes) or any(code != chunk_bytes for code in get_codes):
                codes = sorted({*put_codes, *get_codes} - {0, chunk_bytes})
                raise RuntimeError(f"raw Mooncake calls failed at {chunk_mib} MiB chunks (status {codes})")
            check_loaded()
            store.batch_remove(names, True)
            return store_s, load_s

        # Each run makes room for the next; the fs run also leaves no page cache to reuse.
        runs = {
            "mooncake": jobs_run(tier, lambda keys: store.batch_remove([tier.object_key(key) for key in keys], True)),
            "raw": raw_run,
            "fs": jobs_run(fs_tier, lambda _: shutil.rmtree(fs_root, ignore_errors=True)),
            "mooncake_encrypted": jobs_run(
                encrypted_tier, lambda keys: store.batch_remove([encrypted_tier.object_key(key) for key in keys], True)
            ),
        }
        # One uncounted round first (each client's first transfer opens its connections), then the
        # paths alternate so machine noise hits all alike.
        for warm_up in runs.values():
            warm_up()
        times: dict[str, list[tuple[float, float]]] = {path: [] for path in runs}
        for _ in range(repeats):
            for path, run in runs.items():
                times[path].append(run())

        # The fastest store and the fastest load of each path's timed runs.
        fastest = {
            path: (min(store_s for store_s, _ in timed), min(load_s for _, load_s in timed))
            for path, timed in times.items()
        }
        steps, millis = promotion_latency(tier, promotions, step_ms, keys_for(next(run_ids)), chunks, job_ids)
        promoted = min(promotions, chunks)
        if not np.array_equal(rows[chunks : chunks + promoted], rows[:promoted]):
            raise RuntimeError(f"a timed promotion loaded the wrong bytes at {chunk_mib} MiB")
    finally:
        pool.shutdown()
        tier.shutdown()
        encrypted_tier.shutdown()
        fs_tier.shutdown()
        store.close()
        shutil.rmtree(fs_root, ignore_errors=True)
    (tier_store, tier_load), (raw_store, raw_load) = fastest["mooncake"], fastest["raw"]
    # mooncake_store_gbps, mooncake_load_gbps, raw_store_gbps ... fs_load_gbps
    bandwidths = {
        f"{path}_{direction}_gbps": gbps(total, seconds)
        for path, both in fastest.items()
        for direction, seconds in zip(("store", "load"), both)
    }
    return SizeResult(
        chunk_mib=chunk_mib,
        chunks=chunks,
        **bandwidths,
        store_overhead_ratio=raw_store / tier_store,
        load_overhead_ratio=raw_load / tier_load,
        promotion_steps=steps,
        promotion_ms=millis,
    )


def promotion_latency(
    tier: MooncakeStoreTier,
    promotions: int,
    step_ms: float,
    keys: list[OffloadKey],
    chunks: int,
    job_ids: Iterator[int],
) -> tuple[float, float]:
    """Median steps and ms from a chunk's first lookup to its loaded chunk, one scheduler step every ``step_ms``."""
    end_of_step = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    count = min(promotions, chunks)
    # Cascade the chunks first (not timed).
    for index in range(count):
        job = TransferJob(next(job_ids), [keys[index]], np.array([index]), False, ReqContext(req_id="seed"))
        tier.submit_store(job)
    pending = count
    while pending:
        pending -= sum(1 for _ in tier.get_finished_jobs())
        time.sleep(0.001)

    all_steps: list[int] = []
    all_ms: list[float] = []
    for index in range(count):
        context = ReqContext(req_id=f"promote-{index}")
        key = keys[index]
        started = time.perf_counter()
        steps = 0
        loaded = False
        job_id: int | None = None
        while not loaded:
            steps += 1
            if job_id is None:
                answer = tier.lookup(key, context)
                if answer is LookupResult.HIT:
                    job_id = next(job_ids)
                    tier.submit_load(TransferJob(job_id, [key], np.array([chunks + index]), True, context))
                elif answer is LookupResult.MISS:
                    raise RuntimeError("a cascaded chunk missed")
            tier.on_schedule_end(end_of_step)
            for result in tier.get_finished_jobs():
                if result.job_id == job_id:
                    if not result.success:
                        raise RuntimeError("a promotion failed")
                    loaded = True
            if not loaded:
                time.sleep(step_ms / 1000)
        all_ms.append((time.perf_counter() - started) * 1000)
        all_steps.append(steps)
        tier.on_request_finished(context)
    return float(statistics.median(all_steps)), float(statistics.median(all_ms))


if __name__ == "__main__":
    raise SystemExit(main())
