"""Where ``dma`` beats ``triton``: both backends, both directions, over page sizes; the crossover sets ``AUTO_TABLE``.

Run ``python -m bench.crossover`` on a GPU (``bench/gpu_check.sh`` does).
For each page size (the default ones bracket the 28 KiB from which vLLM's
own handler prefers DMA) and GPU block pattern it builds one engine per
backend over the same pages and pinned slab, runs store jobs and then load
jobs of the same slots (each store finished before its load is submitted:
lanes are not ordered against each other, and a load racing its store would
time a copy of half-written rows), and takes the median job time the engine
itself measures (CUDA events around each job, ``TransferResult.transfer_time``).

It prints, per direction and pattern, the smallest page size from which
``dma`` is faster at every larger size swept, and the ``AutoRule`` line to
add to ``kvtriton.worker._backends.AUTO_TABLE`` where both patterns agree
(docs/worker.md, "Setting AUTO_TABLE"). ``--device cpu`` rehearses the same
code on CPU with ``torch`` in place of ``triton`` (no timing meaning).
JSON goes to ``bench/results/crossover.json`` (``$KVTRITON_BENCH_OUT``),
rewritten after every case; bandwidths are ``bandwidth_GBps`` (10^9 bytes/s).
``--quick`` is a smoke run: tiny sizes, ``crossover-quick.json``, no verdicts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from bench.common import bench_parser, chosen_device, format_table, readable_bytes, result_name, write_json
from bench.kernels import RUN_BLOCKS, KiB, gpu_blocks
from kvtriton import CPULoadStoreSpec, GPULoadStoreSpec
from kvtriton.cli import progress
from kvtriton.worker import HostSlab, PagedKV, TransferEngine


@dataclass(frozen=True, slots=True)
class Timing:
    backend: str
    direction: str
    pattern: str
    page_bytes: int
    seconds: float
    bandwidth_GBps: float
    """Bytes moved per second, in GB/s (10^9 bytes)."""


def time_backend(kv: PagedKV, slab: HostSlab, backend: str, blocks: list[int], jobs: int) -> dict[str, float]:
    """Median seconds per store job and per load job of ``blocks`` into the first slots.

    Each store is finished before the load of the same slots is submitted:
    the lanes run concurrently otherwise, and each would be timed sharing the
    link with the other (the load reading rows still being written).
    """
    slots = CPULoadStoreSpec(list(range(len(blocks))))
    gpu = GPULoadStoreSpec(blocks)
    times: dict[str, list[float]] = {"store": [], "load": []}
    with TransferEngine(kv, slab, backend) as engine:
        for job in range(jobs + 1):  # job 0 warms caches
            for job_id in (2 * job, 2 * job + 1):
                store = job_id % 2 == 0
                accepted = engine.submit_store(job_id, gpu, slots) if store else engine.submit_load(job_id, slots, gpu)
                if not accepted:
                    raise RuntimeError(f"{backend}: job {job_id} was refused (see the log above)")
                engine.wait({job_id})
                for result in engine.get_finished():
                    if not result.success:
                        raise RuntimeError(f"{backend}: job {result.job_id} failed (see the log above)")
                    if job:
                        times["store" if result.transfer_type == ("GPU", "CPU") else "load"].append(
                            result.transfer_time
                        )
    return {direction: statistics.median(values) for direction, values in times.items()}


def crossover(timings: Sequence[Timing], fast: str, direction: str, pattern: str) -> int | None:
    """The smallest page size from which ``dma`` is faster than ``fast`` at every larger size measured so far.

    Only sizes with both backends timed for this direction and pattern count,
    so a sweep cut off part-way still gives the verdict of what it measured.
    """
    by = {(t.backend, t.page_bytes): t.seconds for t in timings if t.direction == direction and t.pattern == pattern}
    sizes = sorted({size for _, size in by if ("dma", size) in by and (fast, size) in by})
    winning = [size for size in sizes if by[("dma", size)] < by[(fast, size)]]
    for size in sizes:
        if all(larger in winning for larger in sizes if larger >= size):
            return size
    return None


def auto_rule_line(direction: str, page_bytes: int) -> str:
    """The ``AutoRule`` to add to ``AUTO_TABLE`` for a crossover (docs/worker.md, "Setting AUTO_TABLE")."""
    return f'AutoRule("cuda", True, TransferDirection.{direction.upper()}, {page_bytes}, TransferBackend.DMA),'


def suggested_rules(crossings: dict[str, int | None], patterns: Sequence[str]) -> dict[str, int | None]:
    """Per direction, the page size from which dma wins with every block pattern (the larger crossover), else None.

    A direction with a pattern not measured yet (absent from ``crossings``) gets no entry: its verdict is unknown.
    """
    rules: dict[str, int | None] = {}
    for direction in ("store", "load"):
        keys = [f"{direction}/{pattern}" for pattern in patterns]
        if any(key not in crossings for key in keys):
            continue
        sizes = [crossings[key] for key in keys]
        rules[direction] = (
            None if any(size is None for size in sizes) else max(size for size in sizes if size is not None)
        )
    return rules


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the cases measured so far say: the crossover per direction and pattern, and the ``AUTO_TABLE`` rows."""

    crossings: dict[str, int | None]
    """``"store/random"`` ->  the page size from which dma wins (None: it never does); measured keys only."""
    rules: dict[str, int | None]
    """Per direction whose every pattern is measured: the ``min_page_bytes`` of its dma row (None: no dma row)."""
    rows: dict[str, str]
    """Per direction in ``rules``: the line to paste into ``AUTO_TABLE``, or why there is none."""
    page_sizes: list[int]
    """The page sizes the verdict rests on (fewer than swept when the run was cut off)."""

    def payload(self) -> dict[str, object]:
        return {
            "crossover_page_bytes": self.crossings,
            "auto_table_min_page_bytes": self.rules,
            "auto_table_rows": self.rows,
            "verdict_page_bytes": self.page_sizes,
        }


def verdict(timings: Sequence[Timing], fast: str, patterns: Sequence[str]) -> Verdict:
    """The verdict of every direction and pattern measured so far.

    Recomputed after every case, so a run cut off keeps the verdict of the cases that finished.
    """
    crossings: dict[str, int | None] = {}
    for direction in ("store", "load"):
        for pattern in patterns:
            if any(t.direction == direction and t.pattern == pattern for t in timings):
                crossings[f"{direction}/{pattern}"] = crossover(timings, fast, direction, pattern)
    rules = suggested_rules(crossings, patterns)
    rows = {
        direction: auto_rule_line(direction, size)
        if size is not None
        else f"no dma row for {direction} ({fast} wins at some size with some pattern)"
        for direction, size in rules.items()
    }
    return Verdict(crossings, rules, rows, sorted({t.page_bytes for t in timings}))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = bench_parser(
        "crossover", __doc__, quick="1 and 4 KiB pages, 2 layers, 16 blocks, 1 job, no verdicts", device=True
    )
    parser.add_argument(
        "--page-kib",
        type=float,
        nargs="+",
        default=[8, 16, 32, 64],
        help="page sizes in KiB (default: 8 16 32 64, around vLLM's 28 KiB)",
    )
    parser.add_argument("--layers", type=int, default=16, help="layers, two page tensors (K, V) each (default: 16)")
    parser.add_argument("--blocks", type=int, default=128, help="blocks per job, a multiple of 16 (default: 128)")
    parser.add_argument("--jobs", type=int, default=5, help="timed jobs per direction, median reported (default: 5)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.page_kib, args.layers, args.blocks, args.jobs = [1, 4], 2, RUN_BLOCKS, 1
        print("SMOKE RUN (--quick): tiny sizes, one job; the figures below are no verdict on anything.")
    if args.blocks < RUN_BLOCKS or args.blocks % RUN_BLOCKS:
        raise SystemExit(f"--blocks must be a positive multiple of {RUN_BLOCKS}, got {args.blocks}")
    name = result_name(args)
    device = chosen_device(args.device)
    fast = "triton" if device == "cuda" else "torch"  # on CPU a rehearsal: the interpreter's timings mean nothing
    page_sizes = sorted({int(kib * KiB) for kib in args.page_kib})
    generator = torch.Generator().manual_seed(0)
    # Blocks out of twice as many: shuffled, or runs of RUN_BLOCKS consecutive blocks in random order.
    patterns = {
        pattern: [int(block) for block in gpu_blocks(pattern, args.blocks, 2 * args.blocks, generator)]
        for pattern in ("random", "runs")
    }
    timings: list[Timing] = []
    payload: dict[str, object] = {
        "device": device,
        "layers": args.layers,
        "blocks": args.blocks,
        "jobs": args.jobs,
        "compared": [fast, "dma"],
        "smoke_run": args.quick,
        "complete": False,
        "results": [],
        "note": "job times are the engine's CUDA-event timings, each store finished before its load; a crossover sets "
        "AUTO_TABLE's min_page_bytes for dma; bandwidth_GBps is 10^9 bytes per second",
    }
    cases = [(size, pattern) for size in page_sizes for pattern in patterns]
    for page_bytes, pattern in progress(cases, len(cases), "dma vs triton", stream=sys.stderr):
        elements = page_bytes // 2  # bf16 pages of (elements,) each
        tensors = [
            torch.randn((2, 2 * args.blocks, elements), device=device).to(torch.bfloat16) for _ in range(args.layers)
        ]
        kv = PagedKV.from_tensors(tensors, layout="flash_attn")
        with HostSlab(args.blocks, 1, kv.row_bytes, pin=device == "cuda") as slab:
            for backend in (fast, "dma"):
                medians = time_backend(kv, slab, backend, patterns[pattern], args.jobs)
                moved = args.blocks * kv.row_bytes
                timings += [
                    Timing(backend, direction, pattern, page_bytes, seconds, moved / seconds / 1e9)
                    for direction, seconds in medians.items()
                ]
        del tensors, kv
        payload["results"] = [asdict(t) for t in timings]
        if not args.quick:  # smoke runs carry no verdict
            payload |= verdict(timings, fast, list(patterns)).payload()
        write_json(name, payload)  # after every case: a run cut short keeps what finished, verdict included
    table = [
        [t.direction, t.pattern, readable_bytes(t.page_bytes), t.backend, t.seconds * 1e3, t.bandwidth_GBps]
        for t in timings
    ]
    print(format_table(["direction", "gpu blocks", "page", "backend", "ms/job", "GB/s"], table))
    if args.quick:
        print("smoke run: no crossover verdict")
    else:
        final = verdict(timings, fast, list(patterns))
        for key, size in final.crossings.items():
            text = f"{fast} at every page size swept" if size is None else f"dma from {readable_bytes(size)} pages on"
            print(f"crossover {key:12s}: {text}")
        if device == "cuda":
            print("AUTO_TABLE (kvtriton/worker/_backends.py; docs/worker.md, 'Setting AUTO_TABLE'):")
            for line in final.rows.values():
                print(f"  {line}")
    payload["complete"] = True
    print(f"wrote {write_json(name, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
