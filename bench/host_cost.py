"""Host cost of a transfer job: ``submit_store`` + ``submit_load`` with the copy itself a no-op, now vs before.

Run ``python -m bench.host_cost`` (``--quick`` for a smoke test). For 64 and 160
page tensors (32 and 80 FlashAttention layers, K and V) and jobs of 1, 16 and
256 blocks it times a loop of ``submit_store``, ``submit_load`` and
``get_finished`` on a ``backend="triton"`` engine whose kernel launch
(``kvtriton.kernels._jit.copy_pages.launch_copy_pages``) is replaced by a no-op,
so only the host path is timed: planning, validation, staging, launch
preparation, events. It reports microseconds per job (two jobs per loop)
for the best pass, the usual figure for a host-overhead microbenchmark on a
shared machine (other processes only ever add time), and the median pass.

The same measurement runs, in the same invocation, on the code path before
the worker redesign: the package as of commit ``BASELINE_COMMIT`` is
extracted from this checkout's git history (``git archive``) into a
temporary folder and measured there, in a child process of its own. Each
tree is measured in a child process with ``PYTHONPATH`` pointing at it, so
the two never share imports. On CPU the kernels take Triton's interpreter
path (``TRITON_INTERPRET=1``), which is the same host path up to the launch;
on CUDA the engine also stages indices and records events.

``--real-launch`` keeps the real kernel launch in the loop (Triton's
launcher included, on CUDA the copies really run): the host cost a server
pays per job, which ``bench/gpu_check.sh`` measures on the GPU. The launch is
part of the figure then, so it has no baseline (``--no-baseline`` is implied).

Beside it, for the same page-tensor and block counts, the host microseconds
the ``dma`` backend's batch path spends building its ``cudaMemcpyBatchAsync``
arrays per job (``DmaCopy.batch_arrays``: one destination, source and size
per page tensor and pair; shuffled blocks into consecutive rows), best and
median pass (``batch_arrays`` in the JSON). Pure host work: it runs the same
with or without a GPU, and leaves out the call itself.

Then, where vLLM is installed (either release), the same counts through
kvtriton's vLLM worker as vLLM 0.34 calls it (``device_pointers`` in the
JSON): each job handed over as ``DevicePointers`` (one address per block and
page tensor), which the worker reads back into block ids before its engine
plans the copy, the launch again a no-op. Per job it times the whole of it
(``submit_store`` + ``submit_load`` + ``get_finished``: ``job_us``) and the
read-back alone (``decode_us``), best and median pass, each beside the same
measurement of the package at ``DEVICE_POINTERS_BASELINE_COMMIT`` (the
worker that looped over every page tensor), extracted and measured in a
child process as the other baseline is. ``--no-device-pointers`` leaves
them out; ``--real-launch`` does too.

Goals: at most 40 us per job at 64 page tensors and 60 us at 160, for the
engine's job and for vLLM 0.34's whole job through the worker alike.
JSON goes to ``bench/results/host_cost.json`` (``$KVTRITON_BENCH_OUT``),
rewritten after every measured tree and page-tensor count (``"complete":
false`` until the end), so a run cut off keeps what it measured.
``--quick`` is a smoke run: ``host_cost-quick.json``, no goals beside its figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

BASELINE_COMMIT = "fa74cdaf86b93282005aaa3dde83ab972f9adb78"
"""The last commit before the worker redesign: the package laid out by side, the old hot path intact."""
DEVICE_POINTERS_BASELINE_COMMIT = "2a106ed28c931bf4f238cc53aad2020b74839e49"
"""The last commit whose worker read vLLM 0.34's device pointers back with a loop over every page tensor."""

ROOT = Path(__file__).resolve().parent.parent
NUM_BLOCKS = 512
GOALS_US = {64: 40.0, 160: 60.0}


def _no_launch(*args: object, **kwargs: object) -> None:
    """The kernel launch replaced: the copy itself is what the host-cost figures leave out."""
    del args, kwargs


def measure(
    page_tensors: int, block_counts: Sequence[int], jobs: int, repeats: int, device: str, real_launch: bool = False
) -> list[dict[str, float]]:
    """Microseconds per job (best and median pass) per block count, on whatever ``kvtriton`` is importable."""
    import importlib

    import torch

    # The package's public names, which the baseline commit exports too; only the jit module moved
    # (kernels/jit/ before the layout by rooms, kernels/_jit/ after it).
    from kvtriton import CPULoadStoreSpec, GPULoadStoreSpec, HostSlab, PagedKV, TransferEngine

    try:
        jit_module = importlib.import_module("kvtriton.kernels._jit.copy_pages")
    except ModuleNotFoundError:
        jit_module = importlib.import_module("kvtriton.kernels.jit.copy_pages")

    if not real_launch:
        setattr(jit_module, "launch_copy_pages", _no_launch)  # the copy itself is what is left out
    layers = page_tensors // 2
    # Small pages: with the copy a no-op, the host path does not depend on the page size.
    tensors = [torch.zeros((2, NUM_BLOCKS, 4, 2, 16), dtype=torch.bfloat16, device=device) for _ in range(layers)]
    kv = PagedKV.from_tensors(tensors)
    slab = HostSlab(NUM_BLOCKS, 1, kv.row_bytes, pin=device == "cuda")
    engine = TransferEngine(kv, slab, "triton")
    results: list[dict[str, float]] = []
    for blocks in block_counts:
        gpu = GPULoadStoreSpec(list(range(blocks)))
        cpu = CPULoadStoreSpec(list(range(NUM_BLOCKS - blocks, NUM_BLOCKS)))
        samples: list[float] = []
        for repeat in range(repeats + 1):  # the first pass warms caches and pools
            started = time.perf_counter()
            for job in range(jobs):
                if not (engine.submit_store(2 * job, gpu, cpu) and engine.submit_load(2 * job + 1, cpu, gpu)):
                    raise RuntimeError("a benchmark job was refused")
                engine.get_finished()
            elapsed = time.perf_counter() - started
            if device == "cuda":
                torch.cuda.synchronize()
                engine.get_finished()
            if repeat:
                samples.append(elapsed / (2 * jobs) * 1e6)
        results.append({"blocks": blocks, "us_per_job": min(samples), "median_us_per_job": statistics.median(samples)})
    engine.shutdown()
    slab.close()
    return results


def measure_device_pointers(
    page_tensors: int, block_counts: Sequence[int], jobs: int, repeats: int, device: str
) -> list[dict[str, float]]:
    """vLLM 0.34's whole job through kvtriton's worker, per block count: device pointers in, the launch a no-op.

    The worker (``VLLMOffloadingWorker``) is handed each job as vLLM 0.34 hands
    it: a slot spec and ``DevicePointers`` (one address per block and page
    tensor, ``base + block_id * stride``), which it reads back into block ids
    before its engine plans the copy. Timed per job: ``submit_store`` +
    ``submit_load`` + ``get_finished`` (``job_us``), and the pointers' read-back
    alone (``worker.device_blocks``, ``decode_us``). Needs vLLM (either release:
    the worker reads pointers whichever one is installed).
    """
    import importlib
    from dataclasses import dataclass

    import numpy as np
    import numpy.typing as npt
    import torch
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvtriton import HostSlab, PagedKV, TransferEngine
    from kvtriton.integrations.vllm import VLLMOffloadingWorker

    setattr(importlib.import_module("kvtriton.kernels._jit.copy_pages"), "launch_copy_pages", _no_launch)

    @dataclass(frozen=True)
    class DevicePointers:  # vLLM 0.34's, by its fields: a job's resolved addresses, reference-major
        ptrs: npt.NDArray[np.uint64]
        sizes: npt.NDArray[np.uint64]
        group_block_counts: tuple[int, ...]
        group_data_ref_counts: tuple[int, ...]
        block_indices: tuple[int, ...]

    layers = [
        torch.zeros((2, NUM_BLOCKS, 4, 2, 16), dtype=torch.bfloat16, device=device) for _ in range(page_tensors // 2)
    ]
    pages = [layer[half] for layer in layers for half in (0, 1)]  # K and V: vLLM's canonical page tensors
    page_bytes = pages[0][0].numel() * pages[0].element_size()
    bases = np.array([[page.data_ptr()] for page in pages], dtype=np.uint64)
    kv = PagedKV.from_tensors(layers)
    slab = HostSlab(NUM_BLOCKS, 1, kv.row_bytes, pin=device == "cuda")
    engine = TransferEngine(kv, slab, "triton")
    worker = VLLMOffloadingWorker([engine], slab, [0], pointer_bases=[[(int(b), page_bytes) for b in bases[:, 0]]])
    results: list[dict[str, float]] = []
    for blocks in block_counts:
        ids = np.arange(blocks, dtype=np.uint64)
        ptrs = (bases + ids * np.uint64(page_bytes)).reshape(-1)
        pointers = DevicePointers(ptrs, np.full(ptrs.size, page_bytes, np.uint64), (blocks,), (len(pages),), (0,))
        slots = CPULoadStoreSpec(list(range(NUM_BLOCKS - blocks, NUM_BLOCKS)))
        job_samples: list[float] = []
        decode_samples: list[float] = []
        for repeat in range(repeats + 1):  # the first pass warms caches and pools
            started = time.perf_counter()
            for job in range(jobs):
                if not (
                    worker.submit_store(2 * job, pointers, slots) and worker.submit_load(2 * job + 1, slots, pointers)
                ):
                    raise RuntimeError("a benchmark job was refused")
                worker.get_finished()
            elapsed = time.perf_counter() - started
            if device == "cuda":
                torch.cuda.synchronize()
                worker.get_finished()
            started = time.perf_counter()
            for _ in range(jobs):
                worker.device_blocks(pointers)
            decoded = time.perf_counter() - started
            if repeat:
                job_samples.append(elapsed / (2 * jobs) * 1e6)
                decode_samples.append(decoded / jobs * 1e6)
        results.append(
            {
                "page_tensors": page_tensors,
                "blocks": blocks,
                "pointers": int(ptrs.size),
                "job_us": min(job_samples),
                "median_job_us": statistics.median(job_samples),
                "decode_us": min(decode_samples),
                "median_decode_us": statistics.median(decode_samples),
            }
        )
    worker.shutdown()
    return results


def measure_batch_arrays(
    page_tensors: int, block_counts: Sequence[int], jobs: int, repeats: int
) -> list[dict[str, float]]:
    """Microseconds to build the batch call's arrays for one job (best and median pass), per block count."""
    import numpy as np
    import torch

    from kvtriton.worker import PagedKV, TransferDirection
    from kvtriton.worker._backends import DmaCopy
    from kvtriton.worker._plan import TransferPlan

    generator = np.random.default_rng(0)
    # Addresses are all the arrays read: small CPU pages stand in for any device's.
    tensors = [torch.zeros((2, NUM_BLOCKS, 4, 2, 16), dtype=torch.bfloat16) for _ in range(page_tensors // 2)]
    kv = PagedKV.from_tensors(tensors)
    backend = DmaCopy(kv, torch.zeros((NUM_BLOCKS, kv.row_bytes), dtype=torch.uint8))
    results: list[dict[str, float]] = []
    for blocks in block_counts:
        plan = TransferPlan(
            TransferDirection.STORE,
            generator.permutation(NUM_BLOCKS)[:blocks].astype(np.int64),
            np.arange(blocks, dtype=np.int64),
        )
        samples: list[float] = []
        for repeat in range(repeats + 1):  # the first pass warms caches
            started = time.perf_counter()
            for _ in range(jobs):
                backend.batch_arrays(plan)
            if repeat:
                samples.append((time.perf_counter() - started) / jobs * 1e6)
        results.append(
            {
                "page_tensors": page_tensors,
                "blocks": blocks,
                "copies": page_tensors * blocks,
                "arrays_us": min(samples),
                "median_arrays_us": statistics.median(samples),
            }
        )
    return results


def _extract_baseline(destination: Path, commit: str = BASELINE_COMMIT) -> Path:
    """The package (``kvtriton/`` and ``kernels/``) as of ``commit``, extracted under ``destination``."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit, "kvtriton", "kernels"],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as error:
        detail = error.stderr.decode().strip() if isinstance(error, subprocess.CalledProcessError) else str(error)
        raise SystemExit(
            f"bench/host_cost.py: cannot read baseline commit {commit[:12]} from git ({detail}); "
            "run it in a git checkout with full history, or pass --no-baseline"
        ) from error
    destination.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive.stdout, check=True)
    return destination


def _run_child(
    tree: Path,
    page_tensors: int,
    block_counts: Sequence[int],
    jobs: int,
    repeats: int,
    device: str,
    real_launch: bool,
    mode: str = "--measure",
) -> list[dict[str, float]]:
    """``mode`` (``--measure``, ``--measure-device-pointers``) run on the package in ``tree``, in a child process."""
    environment = dict(os.environ, PYTHONPATH=str(tree))
    if device == "cpu":
        environment["TRITON_INTERPRET"] = "1"  # the Triton path on CPU tensors (else the torch fallback runs)
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        mode,
        "--page-tensors",
        str(page_tensors),
        "--blocks",
        *map(str, block_counts),
        "--jobs",
        str(jobs),
        "--repeats",
        str(repeats),
        "--device",
        device,
        *(["--real-launch"] if real_launch else []),
    ]
    child = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    if child.returncode != 0:
        raise SystemExit(f"bench/host_cost.py: measuring {tree} failed:\n{child.stderr}")
    return json.loads(child.stdout.strip().splitlines()[-1])


Measured = Mapping[tuple[str, int], Sequence[Mapping[str, float]]]
"""Figures per (tree: ``current`` or ``baseline``, page tensors): one mapping per job measured."""


def _beside_baseline(
    measured: Measured,
    page_tensors: Sequence[int],
    row: Callable[[int, int, Mapping[str, float], Mapping[str, float] | None], dict[str, object]],
) -> list[dict[str, object]]:
    """``row(page tensors, job index, current figures, baseline figures or None)`` per job of each page-tensor count
    measured on the current tree."""
    return [
        row(count, index, now, measured["baseline", count][index] if ("baseline", count) in measured else None)
        for count in page_tensors
        for index, now in enumerate(measured.get(("current", count), ()))
    ]


def result_rows(
    measured: Measured, page_tensors: Sequence[int], block_counts: Sequence[int], goals: Mapping[int, float] | None
) -> list[dict[str, object]]:
    """A row per block count of each page-tensor count measured on the current tree, beside its baseline if measured."""

    def row(count: int, index: int, now: Mapping[str, float], before: Mapping[str, float] | None) -> dict[str, object]:
        figures: dict[str, object] = {
            "page_tensors": count,
            "blocks": block_counts[index],
            "current_us": now["us_per_job"],
            "current_median_us": now["median_us_per_job"],
            "goal_us": None if goals is None else goals.get(count),
        }
        if before is not None:
            figures |= {
                "baseline_us": before["us_per_job"],
                "baseline_median_us": before["median_us_per_job"],
                "speedup": before["us_per_job"] / now["us_per_job"],
            }
        return figures

    return _beside_baseline(measured, page_tensors, row)


def device_pointer_rows(
    measured: Measured, page_tensors: Sequence[int], goals: Mapping[int, float] | None
) -> list[dict[str, object]]:
    """A row per block count of each page-tensor count of the vLLM 0.34 job, beside its baseline if measured."""

    def row(count: int, index: int, now: Mapping[str, float], before: Mapping[str, float] | None) -> dict[str, object]:
        figures: dict[str, object] = {**now, "goal_us": None if goals is None else goals.get(count)}
        if before is not None:
            keys = ("job_us", "median_job_us", "decode_us", "median_decode_us")
            figures |= {f"baseline_{key}": before[key] for key in keys}
        return figures

    return _beside_baseline(measured, page_tensors, row)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.host_cost", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "--page-tensors", type=int, nargs="+", default=[64, 160], help="page tensors per engine (default: 64 160)"
    )
    parser.add_argument(
        "--blocks", type=int, nargs="+", default=[1, 16, 256], help="blocks per job (default: 1 16 256)"
    )
    parser.add_argument("--jobs", type=int, default=200, help="store+load pairs per timed pass (default: 200)")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes; best and median reported (default: 7)")
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto = cuda when available (default)"
    )
    parser.add_argument("--no-baseline", action="store_true", help=f"skip the baseline (commit {BASELINE_COMMIT[:12]})")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 64 page tensors, 1 and 16 blocks, 20 jobs, 2 passes; writes <name>-quick, no goals",
    )
    parser.add_argument(
        "--real-launch",
        action="store_true",
        help="keep the real kernel launch in the timed loop (implies --no-baseline)",
    )
    parser.add_argument("--name", default="host_cost", help="result file stem (default: host_cost)")
    parser.add_argument(
        "--no-device-pointers",
        action="store_true",
        help="skip the vLLM 0.34 job row (device_pointers; skipped anyway where vLLM is not installed)",
    )
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # child mode: print one JSON line
    parser.add_argument("--measure-device-pointers", action="store_true", help=argparse.SUPPRESS)  # child mode too
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if any(count < 1 for count in args.blocks) or max(args.blocks) > NUM_BLOCKS:
        raise SystemExit(f"--blocks must lie in 1..{NUM_BLOCKS}, got {args.blocks}")
    if any(count < 2 or count % 2 for count in args.page_tensors):
        raise SystemExit(f"--page-tensors must be even numbers >= 2 (K and V per layer), got {args.page_tensors}")
    if args.measure:
        print(
            json.dumps(
                measure(args.page_tensors[0], args.blocks, args.jobs, args.repeats, args.device, args.real_launch)
            )
        )
        return 0
    if args.measure_device_pointers:
        # Run as a script, this child has bench/ first on sys.path, where bench/kernels.py would shadow the
        # ``kernels`` package that vLLM's imports (transformers) probe for.
        if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
            del sys.path[0]
        print(
            json.dumps(measure_device_pointers(args.page_tensors[0], args.blocks, args.jobs, args.repeats, args.device))
        )
        return 0
    # Imported only here: a --measure child may run with PYTHONPATH at the baseline tree, which has no bench/.
    from bench.common import chosen_device, format_table, result_name, write_json
    from kvtriton.cli import progress

    device = chosen_device(args.device)
    name = result_name(args)
    if args.real_launch:
        args.no_baseline = True  # the launch is in the figure now; the baseline measured without it
    if args.quick:
        print("SMOKE RUN (--quick): few jobs and passes; the figures below are no verdict on the goals.")
        args.page_tensors, args.blocks, args.jobs, args.repeats = [64], [1, 16], 20, 2
    trees = {"current": ROOT}
    measured: dict[tuple[str, int], list[dict[str, float]]] = {}
    batch_arrays: list[dict[str, float]] = []
    pointers_measured: dict[tuple[str, int], list[dict[str, float]]] = {}
    with_pointers = not (args.no_device_pointers or args.real_launch) and importlib.util.find_spec("vllm") is not None

    def payload(complete: bool) -> dict[str, object]:
        return {
            "device": device,
            "backend": "triton",
            "jobs_per_pass": 2 * args.jobs,
            "repeats": args.repeats,
            "real_launch": args.real_launch,
            "smoke_run": args.quick,
            "complete": complete,
            "baseline_commit": None if args.no_baseline else BASELINE_COMMIT,
            "results": result_rows(measured, args.page_tensors, args.blocks, None if args.quick else GOALS_US),
            "batch_arrays": batch_arrays,
            "device_pointers_baseline_commit": None if args.no_baseline else DEVICE_POINTERS_BASELINE_COMMIT,
            "device_pointers": device_pointer_rows(
                pointers_measured, args.page_tensors, None if args.quick else GOALS_US
            ),
            "note": (
                "host microseconds per submitted job, the real kernel launch included"
                if args.real_launch
                else "host microseconds per submitted job with the kernel launch replaced by a no-op"
            )
            + "; baseline and current (when both) measured in the same run, each in its own child process",
        }

    with tempfile.TemporaryDirectory(prefix="kvtriton-baseline-") as scratch:
        if not args.no_baseline:
            trees["baseline"] = _extract_baseline(Path(scratch))
        cases = [(tree_name, tree, count) for count in args.page_tensors for tree_name, tree in trees.items()]
        for tree_name, tree, count in progress(cases, len(cases), "engine host-cost bench", stream=sys.stderr):
            measured[tree_name, count] = _run_child(
                tree, count, args.blocks, args.jobs, args.repeats, device, args.real_launch
            )
            if tree_name == "current":
                batch_arrays += measure_batch_arrays(count, args.blocks, args.jobs, args.repeats)
            write_json(name, payload(complete=False))  # after every case: a run cut short keeps what finished
        pointer_trees = {"current": ROOT}
        if with_pointers and not args.no_baseline:
            pointer_trees["baseline"] = _extract_baseline(Path(scratch) / "pointers", DEVICE_POINTERS_BASELINE_COMMIT)
        cases = [(tree_name, tree, count) for count in args.page_tensors for tree_name, tree in pointer_trees.items()]
        for tree_name, tree, count in progress(
            cases if with_pointers else [], len(cases) if with_pointers else 0, "vLLM 0.34 job bench", stream=sys.stderr
        ):
            pointers_measured[tree_name, count] = _run_child(
                tree, count, args.blocks, args.jobs, args.repeats, device, False, "--measure-device-pointers"
            )
            write_json(name, payload(complete=False))
    rows = result_rows(measured, args.page_tensors, args.blocks, None if args.quick else GOALS_US)
    headers = [
        "page tensors",
        "blocks",
        "current us/job",
        "(median)",
        "baseline us/job",
        "(median)",
        "speedup",
        "goal us/job",
    ]
    table = [
        [
            r["page_tensors"],
            r["blocks"],
            r["current_us"],
            r["current_median_us"],
            r.get("baseline_us", "-"),
            r.get("baseline_median_us", "-"),
            r.get("speedup", "-"),
            r["goal_us"] or "-",
        ]
        for r in rows
    ]
    print(format_table(headers, table))
    print("\ndma batch path: host us per job building the cudaMemcpyBatchAsync arrays (one copy per page of each pair)")
    print(
        format_table(
            ["page tensors", "blocks", "copies", "us/job", "(median)"],
            [
                [r["page_tensors"], r["blocks"], r["copies"], r["arrays_us"], r["median_arrays_us"]]
                for r in batch_arrays
            ],
        )
    )
    pointer_rows = device_pointer_rows(pointers_measured, args.page_tensors, None if args.quick else GOALS_US)
    if pointer_rows:
        print("\nvLLM 0.34 job through the worker (device pointers in): us per job, and reading the pointers back")
        print(
            format_table(
                [
                    "page tensors",
                    "blocks",
                    "job us",
                    "(median)",
                    "baseline",
                    "decode us",
                    "(median)",
                    "baseline",
                    "goal",
                ],
                [
                    [
                        r["page_tensors"],
                        r["blocks"],
                        r["job_us"],
                        r["median_job_us"],
                        r.get("baseline_job_us", "-"),
                        r["decode_us"],
                        r["median_decode_us"],
                        r.get("baseline_decode_us", "-"),
                        r["goal_us"] or "-",
                    ]
                    for r in pointer_rows
                ],
            )
        )
    elif not args.no_device_pointers and not args.real_launch:
        print("\nvLLM is not installed: no device_pointers rows (the vLLM 0.34 job through the worker)")
    print(f"wrote {write_json(name, payload(complete=True))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
