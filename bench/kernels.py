"""Gather/scatter kernel benchmark: Triton vs torch reference vs per-block copies vs one contiguous copy.

Run ``python -m bench.kernels`` (``--quick`` for a smoke run, ``--gpu-check``
for the trimmed run of ``bench/gpu_check.sh``, ``--ptx`` for the code-quality
summary that needs no GPU). For each kernel (gather: GPU pages -> slab rows;
scatter: the inverse), page size and block count it times

* ``triton``     one launch of a prepared ``CopyLauncher``, as the engine launches (CUDA only; interpreter
                 timings are not performance); ``triton-p<N>`` the same at ``N`` programs (``--triton-programs``),
* ``descriptor`` a descriptor-per-copy Triton kernel in the style of vLLM's ``swap_blocks_triton.py`` (CUDA only),
* ``dma``        the engine's ``dma`` backend as the engine builds it: one ``cudaMemcpyBatchAsync`` per job (one copy
                 per page of each pair) where the runtime has it (CUDA 12.8+) and the slab is pinned, else as ``dma-2d``,
* ``dma-2d``     the same backend held to its per-run path: one ``cudaMemcpy2DAsync`` per run of consecutive blocks and
                 page tensor (on CPU both are the same strided host copies),
* ``torch``      the torch reference (``kernels/_reference.py``, the CPU fallback),
* ``loop``       one ``copy_`` per block per page tensor (what engines do today: one DMA each),
* ``contiguous`` one copy of the same number of bytes between two contiguous buffers (the ceiling),

and prints GB/s (``bandwidth_GBps`` in the JSON: 10^9 bytes per second) and
the ratio to ``contiguous`` measured in the same run. On CUDA every method runs
and is timed on a stream made for the run, never torch's legacy default stream
(CUDA refuses ``cudaMemcpyBatchAsync`` there). A method that raises, while it
is prepared or timed, loses its own row only: its error goes to ``errors`` in
the JSON (kernel, case, method, error) and the other methods are timed.

``--compression fp8-e4m3`` adds the fused fp8 kernels (``triton-fp8`` on
CUDA: one launch of a ``CopyLauncher`` prepared with the row layout; ``torch-fp8``: the
compressed reference) on bf16 pages holding finite values, into a slab of
compressed rows, and reports each against its uncompressed counterpart in
the same run (``fp8_vs_plain`` in the JSON). Their GB/s count the
*uncompressed* page bytes, so the ratio is the source-bytes throughput the
issue's 0.9x GPU goal speaks of.

``--gpu-check`` keeps what decides the goals and fits its budget in
bench/gpu_check.sh: ``triton`` (16 programs) and ``triton-p32``, ``dma``,
``dma-2d`` and ``contiguous`` at four page sizes (32 KiB, the headline size,
first, then 4, 16 and 64 KiB; 256 shuffled blocks, both directions),
``loop`` only at the first case (a reference point: one copy per block is
the slow baseline), with ``--compression`` the fp8 gather at 16, 32 and 64
programs (``--fp8-programs``), and the JSON rewritten after every case, so a
run cut short keeps what finished. On CUDA the JSON also
lists every kernel variant compiled so far with the registers and spills
``ptxas`` gave it (``compiled_variants``, ``kernels_dev/compiled_variants.py``).
``--quick`` runs are smoke runs: labelled so, they write ``<name>-quick``
files and their figures are no verdict on anything. The
headline case is a Llama-3-8B-shaped job: 32 layers x (K, V) pages of 32 KiB,
256 blocks, shuffled GPU blocks into consecutive slab rows; the same job with
random slab rows and with GPU blocks in runs of 16 follows. Every buffer is
written before timing, so no method pays (or skips) first-touch page faults.
JSON and a PNG go to ``bench/results/`` (``$KVTRITON_BENCH_OUT``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from bench.common import bench_parser, chosen_device, format_table, readable_bytes, result_name, results_dir, write_json
from kernels_dev.compiled_variants import compiled_variants, format_variant
from kvtriton.cli import progress
from kvtriton.kernels import (
    DEFAULT_BYTES_PER_ITER,
    DEFAULT_NUM_PROGRAMS,
    CopyLauncher,
    KVCompression,
    compression_layout,
    gather_pages_reference,
    gather_unchecked,
    scatter_pages_reference,
    scatter_unchecked,
)
from kvtriton.worker import HostSlab, PagedKV, TransferDirection
from kvtriton.worker._backends import DmaCopy
from kvtriton.worker._plan import TransferPlan

KiB = 1024
LLAMA3_8B = {"layers": 32, "page_bytes": 32 * KiB, "blocks": 256}
# GPU blocks of the "runs" pattern come in runs of this many consecutive blocks
# (a request's blocks, allocated together), the runs in random order.
RUN_BLOCKS = 16


@dataclass(frozen=True, slots=True)
class Job:
    """One benchmark shape: ``2 * layers`` page tensors (K and V) of ``page_bytes``, ``blocks`` pairs."""

    page_bytes: int
    blocks: int
    layers: int
    rows: str  # slab rows: "consecutive" (fresh slots) or "random" (a fragmented slab)
    pattern: str = "random"  # GPU blocks: "random" (shuffled) or "runs" (runs of RUN_BLOCKS consecutive blocks)
    group: str = "sweep"  # "headline" or "sweep" (the plot shows the sweep)

    @property
    def total_bytes(self) -> int:
        return 2 * self.layers * self.blocks * self.page_bytes


@dataclass(frozen=True, slots=True)
class MethodCase:
    """One method in one direction (``kernel``) of one job: what a result row and an error row both name first."""

    kernel: str
    method: str
    page_bytes: int
    blocks: int
    layers: int
    rows: str
    pattern: str


@dataclass(frozen=True, slots=True)
class ContenderError(MethodCase):
    """A method that raised while it was prepared or timed in one case and direction: its row is missing."""

    error: str


@dataclass(frozen=True, slots=True)
class Result(MethodCase):
    group: str
    seconds: float
    bandwidth_GBps: float
    """Bytes moved per second, in GB/s (10^9 bytes)."""
    vs_contiguous: float | None
    """Seconds of ``contiguous`` over this method's (None when ``contiguous`` itself failed in this case)."""
    programs: int | None = None
    """The Triton grid cap the method ran with (None: not a Triton kernel)."""

    @property
    def case(self) -> tuple[str, int, int, int, str, str, str]:
        """What two methods compared in one run share: the kernel and the job."""
        return (self.kernel, self.page_bytes, self.blocks, self.layers, self.rows, self.pattern, self.group)


def gpu_blocks(pattern: str, count: int, cache_blocks: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct block ids below ``cache_blocks``: shuffled, or runs of consecutive ids in random order."""
    if pattern == "random":
        return torch.randperm(cache_blocks, generator=generator)[:count]
    if pattern != "runs":
        raise ValueError(f"pattern must be 'random' or 'runs', got {pattern!r}")
    run = min(RUN_BLOCKS, count)
    slots = torch.randperm(cache_blocks // run, generator=generator)[: -(-count // run)]
    return (slots[:, None] * run + torch.arange(run)).flatten()[:count]


def fill_distinct(tensor: torch.Tensor, start: int) -> int:
    """Fill a contiguous tensor (bytes a multiple of 8) with consecutive int64 values from ``start``; the next start.

    Every 8-byte word differs, so no two memory pages hold the same bytes:
    constant fills let the hypervisor (or KSM) merge pages, after which
    reading them hits the cache and writing them faults, both untypical of a
    KV cache.
    """
    words = tensor.view(-1).view(torch.int64)
    torch.arange(start, start + words.numel(), dtype=torch.int64, device=tensor.device, out=words)
    return start + words.numel()


def _slab(rows: int, row_bytes: int, pin: bool) -> tuple[HostSlab | None, torch.Tensor]:
    """A pinned HostSlab and its rows, or (``pin`` false) a pageable tensor of the same shape.

    On CUDA the slab is a HostSlab, registered chunk by chunk as in production
    (not torch's pinned allocator), so the kernels are timed against the
    memory they will really read and write.
    """
    if not pin:
        return None, torch.empty((rows, row_bytes), dtype=torch.uint8)
    slab = HostSlab(rows, 1, row_bytes, pin=True)
    return slab, slab.rows


def _paged(pages: Sequence[torch.Tensor]) -> PagedKV:
    """The engine's view of the fixture's page tensors, named ``page0``, ``page1``, ..."""
    return PagedKV(list(pages), [f"page{t}" for t in range(len(pages))])


class Fixture:
    """Page tensors (FlashAttention layout, one ``(2, N, page)`` tensor per layer), slab, indices, buffers.

    Every buffer is written once here with distinct words (``fill_distinct``),
    so that no timed copy pays first-touch page faults, and none reads
    never-written memory (which the kernel maps to one shared zero page: a
    "copy" from it never leaves the cache) or pages merged for equal content.
    """

    def __init__(
        self, job: Job, device: torch.device, pin: bool, seed: int = 0, compression: KVCompression = KVCompression.NONE
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        value_generator = torch.Generator(device).manual_seed(seed)
        spare = max(8, job.blocks // 8)
        cache_blocks = job.blocks + spare + RUN_BLOCKS
        words = job.page_bytes // 8
        self.layers = [
            torch.empty((2, cache_blocks, words), dtype=torch.int64, device=device) for _ in range(job.layers)
        ]
        start = 0
        for layer in self.layers:
            if compression is KVCompression.NONE:
                start = fill_distinct(layer, start)
            else:
                # Compression refuses NaN and infinity (which distinct int64 words read as bf16 contain):
                # finite KV-like values instead, every word still different.
                # Drawn on the pages' device: on a GPU a CPU draw of 10^8 values would dominate the case.
                values = layer.view(-1).view(torch.bfloat16)
                values.copy_(torch.randn(values.numel(), generator=value_generator, device=device, dtype=torch.float32))
        self.pages = [layer[kv] for layer in self.layers for kv in range(2)]
        row_bytes = job.page_bytes * len(self.pages)
        rows = job.blocks + spare
        self.host_slab, self.slab = _slab(rows, row_bytes, pin)
        start = fill_distinct(self.slab, start)
        blocks = gpu_blocks(job.pattern, job.blocks, cache_blocks, generator)
        row_ids = (
            torch.arange(3, 3 + job.blocks)
            if job.rows == "consecutive"
            else torch.randperm(rows, generator=generator)[: job.blocks]
        )
        self.blocks = blocks.to(device)
        self.rows = row_ids.to(device)
        self.block_list = [int(b) for b in blocks]
        self.row_list = [int(r) for r in row_ids]
        self.page_bytes = job.page_bytes
        # The ceiling: the same bytes between one contiguous device buffer and the slab.
        self.flat = torch.empty(job.total_bytes, dtype=torch.uint8, device=device)
        fill_distinct(self.flat, start)
        self.slab_flat = self.slab.view(-1)[: job.total_bytes]
        self.device = device
        self.compressed_pages: list[torch.Tensor] = []
        self.compressed_slab: torch.Tensor | None = None
        if compression is not KVCompression.NONE:
            self.compressed_pages = [page.view(torch.bfloat16) for page in self.pages]
            self.layout = compression_layout(self.compressed_pages)
            self.compressed_host_slab, self.compressed_slab = _slab(rows, self.layout.row_bytes, pin)
            fill_distinct(self.compressed_slab, start)


def _loop(fixture: Fixture, to_slab: bool) -> Callable[[], object]:
    pages = [page.view(torch.uint8) for page in fixture.pages]
    size = fixture.page_bytes
    non_blocking = fixture.device.type == "cuda"

    def run() -> None:
        for t, page in enumerate(pages):
            column = t * size
            for block, row in zip(fixture.block_list, fixture.row_list):
                if to_slab:
                    fixture.slab[row, column : column + size].copy_(page[block], non_blocking=non_blocking)
                else:
                    page[block].copy_(fixture.slab[row, column : column + size], non_blocking=non_blocking)

    return run


def _triton(fixture: Fixture, to_slab: bool, num_programs: int, bytes_per_iter: int) -> Callable[[], object]:
    """One launch of a ``CopyLauncher`` prepared here, outside the timed call, as the engine prepares it."""
    launcher = CopyLauncher(
        fixture.pages,
        fixture.slab,
        _paged(fixture.pages).geometry,
        interpret=False,
        num_programs=num_programs,
        bytes_per_iter=bytes_per_iter,
    )
    return functools.partial(launcher.launch, to_slab, fixture.blocks, fixture.rows)


def _descriptor(fixture: Fixture, to_slab: bool, num_programs: int) -> Callable[[], object]:
    from kvtriton.kernels._jit.descriptor_copy import launch_descriptor_copy

    size = fixture.page_bytes
    stride = fixture.slab.stride(0)
    entries: list[tuple[int, int, int]] = []
    for t, page in enumerate(fixture.pages):
        for block, row in zip(fixture.block_list, fixture.row_list):
            gpu = page.data_ptr() + block * page.stride(0) * 8
            host = fixture.slab.data_ptr() + row * stride + t * size
            entries.append((gpu, host, size) if to_slab else (host, gpu, size))
    descriptors = torch.tensor(entries, dtype=torch.int64, device=fixture.device)
    return lambda: launch_descriptor_copy(descriptors, grid=num_programs)


def _dma(fixture: Fixture, to_slab: bool, batched: bool) -> Callable[[], object]:
    """The engine's dma backend over the fixture's pages and slab: its batch call where it has one (``batched``),
    else runs of consecutive blocks, one 2-D copy each."""
    kv = _paged(fixture.pages)
    registration_rows = fixture.host_slab.registration_rows if fixture.host_slab else None
    pinned = fixture.host_slab.pinned if fixture.host_slab else False  # the engine's batch/per-run choice
    backend = DmaCopy(kv, fixture.slab, registration_rows, slab_pinned=pinned, batched=batched)
    direction = TransferDirection.STORE if to_slab else TransferDirection.LOAD
    plan = TransferPlan(
        direction, np.array(fixture.block_list, dtype=np.int64), np.array(fixture.row_list, dtype=np.int64)
    )
    return lambda: backend.copy(plan, None)


TRIMMED_METHODS = ("triton", "dma", "dma-2d", "contiguous")
"""What ``--gpu-check`` times (plus ``loop`` at one reference point), each with its ``-p<N>`` and fp8 variants."""

TRITON_PROGRAM_COUNTS = (32,)
"""``--gpu-check``: the program counts plain ``triton`` is timed at besides ``--num-programs`` (16)."""

FP8_PROGRAM_COUNTS = (16, 32, 64)
"""``--gpu-check``: the program counts the fused fp8 gather is timed at (the copy kernel's default is 16)."""


class Contender(NamedTuple):
    """One timed method: the call, and the Triton grid cap it launches with (None: not a Triton kernel)."""

    run: Callable[[], object]
    programs: int | None = None


def prepared(make: Callable[[], Callable[[], object]], programs: int | None = None) -> Contender:
    """The contender ``make`` prepares; one whose preparation raised fails with that error when it is timed.

    So a method that cannot even be built (no libcudart for ``dma``, a kernel
    that does not compile) costs its own row, never the case.
    """
    try:
        return Contender(make(), programs)
    except Exception as error:  # noqa: BLE001 -- reported per contender by time_round_robin
        failure = error  # the except clause unbinds ``error`` when it ends

        def fail() -> None:
            raise failure

        return Contender(fail, programs)


_PROGRAMS_SUFFIX = re.compile(r"-p\d+$")


def base_method(name: str) -> str:
    """``triton-fp8-p32`` -> ``triton``, ``triton-p32`` -> ``triton``, ``torch-fp8`` -> ``torch``, ``dma-2d`` -> ``dma-2d``.

    The plain counterpart at the default program count.
    """
    return _PROGRAMS_SUFFIX.sub("", name.split("-fp8")[0])


def methods(
    fixture: Fixture,
    to_slab: bool,
    num_programs: int,
    bytes_per_iter: int,
    only: Sequence[str] | None = None,
    fp8_programs: Sequence[int] = (),
    triton_programs: Sequence[int] = (),
) -> dict[str, Contender]:
    """The contenders for one fixture and direction (CUDA-only ones where there is a GPU); ``only`` keeps those named.

    ``triton`` is a prepared :class:`~kvtriton.kernels._launch.CopyLauncher`,
    as the engine launches: the page table, the launch configuration and the
    launcher are built here, outside the timed call, so it is timed on the
    same footing as ``triton-fp8`` (a prepared launcher) and ``dma`` (a
    prepared backend). ``fp8_programs``: further program counts the fp8
    gather is timed at, as ``triton-fp8-p<N>``; ``triton_programs`` the same
    for plain ``triton`` (both directions), as ``triton-p<N>``.
    """
    found: dict[str, Contender] = {}
    if fixture.device.type == "cuda":
        for programs in (num_programs, *(count for count in triton_programs if count != num_programs)):
            name = "triton" if programs == num_programs else f"triton-p{programs}"
            found[name] = prepared(functools.partial(_triton, fixture, to_slab, programs, bytes_per_iter), programs)
        found["descriptor"] = prepared(functools.partial(_descriptor, fixture, to_slab, num_programs), num_programs)
    found["dma"] = prepared(functools.partial(_dma, fixture, to_slab, True))
    found["dma-2d"] = prepared(functools.partial(_dma, fixture, to_slab, False))
    pages, slab, blocks, rows = fixture.pages, fixture.slab, fixture.blocks, fixture.rows
    if to_slab:
        found["torch"] = Contender(lambda: gather_pages_reference(pages, slab, blocks, rows))
    else:
        found["torch"] = Contender(lambda: scatter_pages_reference(slab, pages, rows, blocks))
    found["loop"] = Contender(_loop(fixture, to_slab))
    non_blocking = fixture.device.type == "cuda"
    source, target = (fixture.flat, fixture.slab_flat) if to_slab else (fixture.slab_flat, fixture.flat)
    found["contiguous"] = Contender(lambda: target.copy_(source, non_blocking=non_blocking))
    if fixture.compressed_slab is not None:
        extra_programs = fp8_programs if to_slab else ()  # the gather quantizes: its program count is what may matter
        found.update(_compressed_methods(fixture, to_slab, num_programs, bytes_per_iter, extra_programs))
    if only is not None:
        found = {name: method for name, method in found.items() if base_method(name) in only}
    return found


def _compressed_methods(
    fixture: Fixture, to_slab: bool, num_programs: int, bytes_per_iter: int, extra_programs: Sequence[int]
) -> dict[str, Contender]:
    """``triton-fp8`` (CUDA: one prepared launch, no status read-back), ``triton-fp8-p<N>`` and ``torch-fp8``.

    ``triton-fp8`` launches on ``num_programs`` programs, as ``triton`` does;
    ``triton-fp8-p<N>`` is the same kernel prepared with ``num_programs=N`` for
    each other N of ``extra_programs`` (the launcher caps the grid at it, so
    the kernels need no knob of their own). ``torch-fp8`` is the compressed
    reference.
    """
    slab, pages, layout = fixture.compressed_slab, fixture.compressed_pages, fixture.layout
    assert slab is not None
    found: dict[str, Contender] = {}
    geometry = _paged(pages).geometry
    if fixture.device.type == "cuda":
        status = torch.zeros(1, dtype=torch.int32, device=fixture.device)
        for programs in (num_programs, *(count for count in extra_programs if count != num_programs)):

            def make(programs: int = programs) -> Callable[[], object]:
                launcher = CopyLauncher(
                    pages,
                    slab,
                    geometry,
                    compression=layout,
                    interpret=False,
                    num_programs=programs,
                    bytes_per_iter=bytes_per_iter,
                )
                return functools.partial(launcher.launch, to_slab, fixture.blocks, fixture.rows, status)

            name = "triton-fp8" if programs == num_programs else f"triton-fp8-p{programs}"
            found[name] = prepared(make, programs)
    blocks, rows = fixture.blocks, fixture.rows
    if to_slab:
        found["torch-fp8"] = Contender(lambda: gather_unchecked(pages, slab, blocks, rows, geometry, layout))
    else:
        found["torch-fp8"] = Contender(lambda: scatter_unchecked(slab, pages, rows, blocks, geometry, layout))
    return found


def describe_error(error: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters): what a failed contender's row records."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def timing_stream(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Where the methods run: on CUDA a stream made for the run (never torch's legacy default stream, on which
    CUDA refuses ``cudaMemcpyBatchAsync``); on CPU nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))


def _time_once(run: Callable[[], object], device: torch.device) -> float:
    if device.type != "cuda":
        began = time.perf_counter()
        run()
        return time.perf_counter() - began
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()  # on the current stream: timing_stream's
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def time_round_robin(
    contenders: dict[str, Callable[[], object]], repeats: int, device: torch.device
) -> tuple[dict[str, float], dict[str, str]]:
    """Median seconds per method, and the error of each method that raised (it is timed no further).

    Methods alternate within each repeat so drift hits all alike; all of them
    run on :func:`timing_stream`'s stream. One method's failure costs its own
    row, never the others'.
    """
    errors: dict[str, str] = {}
    samples: dict[str, list[float]] = {name: [] for name in contenders}

    def attempt(name: str, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as error:  # noqa: BLE001 -- the error is the method's result, recorded per method
            errors[name] = describe_error(error)
            samples.pop(name, None)

    with timing_stream(device):
        for name, fn in contenders.items():  # warm-up: compile, fault pages in
            attempt(name, fn)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for _ in range(repeats):
            for name, fn in contenders.items():
                if name in samples:
                    attempt(name, lambda name=name, fn=fn: samples[name].append(_time_once(fn, device)))
    return {name: statistics.median(values) for name, values in samples.items()}, errors


def run_job(
    job: Job,
    device: torch.device,
    pin: bool,
    repeats: int,
    num_programs: int,
    bytes_per_iter: int,
    only: Sequence[str] | None = None,
    compression: KVCompression = KVCompression.NONE,
    fp8_programs: Sequence[int] = (),
    triton_programs: Sequence[int] = (),
) -> tuple[list[Result], list[ContenderError]]:
    """The rows of every method that ran for ``job`` in both directions, and the error of each one that raised."""
    fixture = Fixture(job, device, pin, compression=compression)
    results: list[Result] = []
    failures: list[ContenderError] = []
    for to_slab in (True, False):
        kernel = "gather" if to_slab else "scatter"
        contenders = methods(fixture, to_slab, num_programs, bytes_per_iter, only, fp8_programs, triton_programs)
        timings, errors = time_round_robin(
            {name: contender.run for name, contender in contenders.items()}, repeats, device
        )
        ceiling = timings.get("contiguous")
        for method, seconds in timings.items():
            results.append(
                Result(
                    kernel,
                    method,
                    job.page_bytes,
                    job.blocks,
                    job.layers,
                    job.rows,
                    job.pattern,
                    job.group,
                    seconds,
                    job.total_bytes / seconds / 1e9,
                    None if ceiling is None else ceiling / seconds,
                    contenders[method].programs,
                )
            )
        failures += [
            ContenderError(kernel, method, job.page_bytes, job.blocks, job.layers, job.rows, job.pattern, error)
            for method, error in errors.items()
        ]
    return results, failures


def sweep_jobs(page_sizes: Sequence[int], block_counts: Sequence[int], layers: int, max_bytes: int) -> list[Job]:
    """Every page size x block count; layers shrink where a job would exceed ``max_bytes``."""
    jobs: list[Job] = []
    for page in page_sizes:
        for blocks in block_counts:
            fitting = max(1, min(layers, max_bytes // (2 * blocks * page)))
            jobs.append(Job(page, blocks, fitting, "consecutive"))
    return jobs


def print_ptx_summary(
    page_sizes: Sequence[int], num_pages: int, bytes_per_iter: int = DEFAULT_BYTES_PER_ITER
) -> list[dict[str, object]]:
    """Access widths of the production kernels per page size, next to the descriptor-per-copy baseline.

    Also what one program issues per loop iteration (the loop body's global
    accesses per thread times the threads): host reads are latency-bound, so
    that is the bytes a program keeps in flight.
    """
    from kernels_dev.codegen import CompiledKernel, compile_copy_pages, compile_descriptor_copy, production_config

    rows: list[list[object]] = []
    records: list[dict[str, object]] = []

    def wide_loads(kernel: CompiledKernel) -> int:
        """16-byte loads one program issues per loop iteration."""
        return kernel.loop_accesses().loads.get(16, 0) * kernel.threads

    def table_row(kernel: CompiledKernel, tile: str, multiplies: str) -> list[object]:
        accesses, wide = kernel.accesses(), wide_loads(kernel)
        return [
            kernel.name,
            tile,
            kernel.threads,
            accesses.widest_load,
            accesses.widest_store,
            kernel.loop_accesses().describe(),
            wide,
            f"{wide * 16 / KiB:g}",
            multiplies,
        ]

    for page in page_sizes:
        config = production_config(page, num_pages, bytes_per_iter)
        tile = f"{config.pairs} x {config.chunk * config.element_bytes} B"
        for to_slab in (True, False):
            kernel = compile_copy_pages(config, to_slab=to_slab)
            accesses = kernel.accesses()
            loop = kernel.loop_accesses()
            narrow = kernel.narrow_multiplies()
            rows.append(table_row(kernel, tile, "none" if not narrow else ", ".join(narrow)))
            records.append(
                {
                    "kernel": kernel.name,
                    "pairs": config.pairs,
                    "chunk_bytes": config.chunk * config.element_bytes,
                    "threads": kernel.threads,
                    "loads": accesses.loads,
                    "stores": accesses.stores,
                    "loop_loads_per_thread": loop.loads,
                    "loop_stores_per_thread": loop.stores,
                    "loads_16b_per_iteration_per_program": wide_loads(kernel),
                    "narrow_multiplies": narrow,
                }
            )
    baseline = compile_descriptor_copy()
    rows.append(table_row(baseline, "-", "-"))
    accesses = baseline.accesses()
    records.append(
        {
            "kernel": baseline.name,
            "loads": accesses.loads,
            "stores": accesses.stores,
            "loop_loads_per_thread": baseline.loop_accesses().loads,
        }
    )
    print("PTX for sm_90 (compiled on this machine, no GPU needed): global access width in bytes per thread;")
    print(f"'per iteration' = the persistent loop's body, per thread; bytes_per_iter = {bytes_per_iter}")
    headers = [
        "kernel",
        "tile (pairs x chunk)",
        "threads",
        "widest ld",
        "widest st",
        "per iteration, per thread",
        "16B loads/iter/program",
        "16B KiB/iter",
        "32-bit address multiplies",
    ]
    print(format_table(headers, rows))
    return records


def plot(results: Sequence[Result], path_stem: str) -> str | None:
    """GB/s against page size per method, one panel per kernel (largest block count)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dev dependency
        return None
    sweep = [r for r in results if r.group == "sweep"]
    if not sweep:
        return None
    blocks = max(r.blocks for r in sweep)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axis, kernel in zip(axes, ("gather", "scatter")):
        for method in sorted({r.method for r in sweep}):
            points = sorted(
                (r.page_bytes, r.bandwidth_GBps)
                for r in sweep
                if r.kernel == kernel and r.method == method and r.blocks == blocks
            )
            if points:
                axis.plot([p / KiB for p, _ in points], [g for _, g in points], marker="o", label=method)
        sizes = sorted({r.page_bytes for r in sweep})
        axis.set_xscale("log", base=2)
        axis.set_xticks([size / KiB for size in sizes], [readable_bytes(size) for size in sizes])
        axis.minorticks_off()
        axis.set_xlabel("page size")
        axis.set_title(f"{kernel}, {blocks} blocks")
        axis.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    figure.tight_layout()
    path = results_dir() / f"{path_stem}.png"
    figure.savefig(path, dpi=120)  # pyright: ignore[reportUnknownMemberType] -- matplotlib types **kwargs as Unknown
    plt.close(figure)
    return str(path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = bench_parser(
        "kernels", __doc__, quick="4 and 32 KiB pages, 32 blocks, 4 layers, 3 repeats, no verdicts", device=True
    )
    parser.add_argument(
        "--page-kib", type=int, nargs="+", help="page sizes in KiB (default: 1 4 16 64 256; --gpu-check: 4 16 32 64)"
    )
    parser.add_argument(
        "--blocks", type=int, nargs="+", help="block counts per job (default: 32 256; --gpu-check: 256)"
    )
    parser.add_argument(
        "--layers", type=int, default=32, help="layers per sweep job, 2 page tensors each (default: 32)"
    )
    parser.add_argument(
        "--max-mib",
        type=int,
        default=512,
        help="cap on bytes moved per sweep job; fewer layers above it (default: 512)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per method, median reported (default: 7)")
    parser.add_argument(
        "--num-programs",
        type=int,
        default=DEFAULT_NUM_PROGRAMS,
        help=f"Triton programs (default: {DEFAULT_NUM_PROGRAMS})",
    )
    parser.add_argument(
        "--bytes-per-iter",
        type=int,
        default=DEFAULT_BYTES_PER_ITER,
        help=f"bytes per program iteration (default: {DEFAULT_BYTES_PER_ITER})",
    )
    parser.add_argument(
        "--no-pin", action="store_true", help="use a pageable slab on CUDA (the Triton path then refuses it)"
    )
    parser.add_argument(
        "--gpu-check",
        action="store_true",
        help="the trimmed run of bench/gpu_check.sh: triton, dma and contiguous at 32/4/16/64 KiB pages "
        "(or --page-kib; 32 KiB first), --blocks 256, one loop reference point, the fp8 gather at 16/32/64 programs, "
        "JSON after every case",
    )
    parser.add_argument("--no-plot", action="store_true", help="write no PNG (the GPU check brings back few files)")
    parser.add_argument(
        "--ptx", action="store_true", help="print the sm_90 access-width summary and exit (no GPU needed)"
    )
    parser.add_argument(
        "--no-headline", action="store_true", help="skip the four Llama-3-8B headline jobs (run the sweep only)"
    )
    parser.add_argument(
        "--fp8-programs",
        type=int,
        nargs="+",
        help="with --compression: program counts to time the fp8 gather at besides --num-programs, as triton-fp8-p<N> "
        f"(default: none; --gpu-check: {' '.join(map(str, FP8_PROGRAM_COUNTS))})",
    )
    parser.add_argument(
        "--triton-programs",
        type=int,
        nargs="+",
        help="program counts to time plain triton at besides --num-programs, as triton-p<N> "
        f"(default: none; --gpu-check: {' '.join(map(str, TRITON_PROGRAM_COUNTS))})",
    )
    parser.add_argument(
        "--compression",
        choices=[member.value for member in KVCompression],
        default="none",
        help="also time the fused fp8 kernels against the plain ones in the same run (default: none)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick and args.gpu_check:
        raise SystemExit("--quick and --gpu-check are different runs; pick one")
    default_kib = [32, 4, 16, 64] if args.gpu_check else [1, 4, 16, 64, 256]
    page_sizes = [kib * KiB for kib in (args.page_kib or default_kib)]
    if args.gpu_check:  # the headline page size first: a run cut off has measured it
        page_sizes.sort(key=lambda size: size != LLAMA3_8B["page_bytes"])
    for option, counts in (("--fp8-programs", args.fp8_programs), ("--triton-programs", args.triton_programs)):
        if any(count < 1 for count in counts or ()):
            raise SystemExit(f"{option} must be >= 1, got {counts}")
    default_fp8_programs: list[int] = list(FP8_PROGRAM_COUNTS) if args.gpu_check else []
    fp8_programs: list[int] = args.fp8_programs if args.fp8_programs is not None else default_fp8_programs
    default_triton_programs: list[int] = list(TRITON_PROGRAM_COUNTS) if args.gpu_check else []
    triton_programs: list[int] = args.triton_programs if args.triton_programs is not None else default_triton_programs
    if args.ptx:
        records = print_ptx_summary(sorted({*page_sizes, 656, 4097}), 2 * LLAMA3_8B["layers"], args.bytes_per_iter)
        print(f"wrote {write_json(args.name + '_ptx', {'ptx': records})}")
        return 0
    device = torch.device(chosen_device(args.device))
    pin = device.type == "cuda" and not args.no_pin
    name = result_name(args)
    compression = KVCompression.parse(args.compression, "--compression")
    only: tuple[str, ...] | None = None
    if args.quick:
        print("SMOKE RUN (--quick): tiny sizes, few repeats; the figures below are no verdict on anything.")
        page_sizes, block_counts, layers, repeats = [4 * KiB, 32 * KiB], [32], 4, 3
        headline = [Job(32 * KiB, 64, 8, "consecutive", "random", "headline")]
    elif args.gpu_check:
        block_counts, layers, repeats, headline = args.blocks or [256], args.layers, args.repeats, []
        only = TRIMMED_METHODS
    else:
        block_counts, layers, repeats = args.blocks or [32, 256], args.layers, args.repeats
        llama = (LLAMA3_8B["page_bytes"], LLAMA3_8B["blocks"], LLAMA3_8B["layers"])
        # The headline first: shuffled GPU blocks (no help from block runs) into fresh, consecutive slab slots.
        headline = [
            Job(*llama, rows, pattern, "headline")
            for pattern, rows in itertools.product(("random", "runs"), ("consecutive", "random"))
        ]
    if args.no_headline:
        headline = []
    if device.type == "cpu":
        print("CPU only: timing the torch paths; Triton timings need CUDA (interpreter timings are not performance).")
    jobs = headline + sweep_jobs(page_sizes, block_counts, layers, args.max_mib * 2**20)
    payload: dict[str, object] = {
        "device": str(device),
        "pinned_slab": pin,
        "num_programs": args.num_programs,
        "bytes_per_iter": args.bytes_per_iter,
        "repeats": repeats,
        "smoke_run": args.quick,
        "complete": False,
        "results": [],
        "errors": [],
        "note": "ratios are against one contiguous copy of the same bytes measured in the same run; "
        "bandwidth_GBps is 10^9 bytes per second",
    }
    results: list[Result] = []
    failures: list[ContenderError] = []
    for index, job in enumerate(progress(jobs, len(jobs), "kernel bench", stream=sys.stderr)):
        # --gpu-check: the per-block loop only at the first (headline) case, as a reference point.
        job_methods = (*only, "loop") if only is not None and index == 0 else only
        job_results, job_failures = run_job(
            job,
            device,
            pin,
            repeats,
            args.num_programs,
            args.bytes_per_iter,
            job_methods,
            compression,
            fp8_programs,
            triton_programs,
        )
        results += job_results
        failures += job_failures
        payload["results"] = [asdict(r) for r in results]
        payload["errors"] = [asdict(failure) for failure in failures]
        if compression is not KVCompression.NONE:
            payload["fp8_vs_plain"] = [asdict(ratio) for ratio in fp8_ratios(results)]
        if device.type == "cuda":  # what ptxas made of each variant under this machine's Triton
            payload["compiled_variants"] = compiled_variants()
        write_json(name, payload)  # after every case: a run cut short keeps what finished
    headers = ["kernel", "method", "page KiB", "blocks", "layers", "gpu blocks", "slab rows", "GB/s", "x contiguous"]
    table = [
        [
            r.kernel,
            r.method,
            r.page_bytes // KiB,
            r.blocks,
            r.layers,
            r.pattern,
            r.rows,
            r.bandwidth_GBps,
            r.vs_contiguous,
        ]
        for r in results
    ]
    print(format_table(headers, table))
    head = [r for r in results if r.group == "headline"]
    if headline:
        title = "Llama-3-8B-shaped job: 32 layers x K,V 32 KiB pages, 256 blocks" if not args.quick else "smoke run"
        print(f"\nheadline ({title}); * = the headline pattern: shuffled GPU blocks into consecutive slab rows")
        first = (headline[0].pattern, headline[0].rows)
        for kernel in ("gather", "scatter"):
            for r in (r for r in head if r.kernel == kernel):
                mark = "*" if (r.pattern, r.rows) == first else " "
                print(
                    f" {mark}{r.kernel:7s} {r.method:10s} blocks={r.pattern:6s} rows={r.rows:11s} {r.bandwidth_GBps:8.2f} GB/s  {r.vs_contiguous:.3f} x contiguous"
                )
    if args.gpu_check:
        print_trimmed_summary(results)
    for failure in failures:
        print(
            f"FAILED {failure.method} ({failure.kernel}, {readable_bytes(failure.page_bytes)}, {failure.blocks} blocks): "
            f"{failure.error}"
        )
    if compression is not KVCompression.NONE:
        print("\nfp8-e4m3 against plain, same run (uncompressed bytes per second; 1.0 = as fast as the plain copy):")
        for ratio in fp8_ratios(results):
            print(
                f"  {ratio.kernel:7s} {ratio.fp8_method:15s} vs {ratio.method:7s} "
                f"{readable_bytes(ratio.page_bytes):>7s} blocks={ratio.blocks}: {ratio.ratio:.3f}"
            )
    variants = compiled_variants() if device.type == "cuda" else []
    if variants:
        print(f"\ncompiled Triton variants ({len(variants)}): registers and spills per thread, as ptxas reported them")
        for record in variants:
            shown = ("TO_SLAB", "PAGE_ELEMS", "CHUNK", "PAIRS", "WORD", "ELEMENTS", "TILE_GROUPS")
            print("  " + format_variant(record, shown))
    payload["complete"] = True
    png = None if args.no_plot else plot(results, name)
    if png:
        payload["plot"] = Path(png).name  # beside the JSON; no machine-specific absolute path
    print(f"wrote {write_json(name, payload)}" + (f" and {png}" if png else ""))
    return 0


@dataclass(frozen=True, slots=True)
class Fp8Ratio:
    """One case and kernel: plain seconds over the fp8 method's seconds (1.0: compression costs nothing).

    ``method`` is the plain counterpart (``triton``), ``fp8_method`` the fp8
    one (``triton-fp8``, or ``triton-fp8-p32`` for another program count),
    ``programs`` the fp8 method's grid cap (None for the torch reference).
    """

    kernel: str
    method: str
    page_bytes: int
    blocks: int
    layers: int
    pattern: str
    rows: str
    ratio: float
    fp8_method: str
    programs: int | None


def fp8_ratios(results: Sequence[Result]) -> list[Fp8Ratio]:
    """Per case and kernel: each fp8 method against its plain counterpart (at its own program count) in the same run."""
    ratios: list[Fp8Ratio] = []
    for r in results:
        if "-fp8" not in r.method:
            continue
        plain = base_method(r.method)
        for other in results:
            if other.case == r.case and other.method == plain:
                ratios.append(
                    Fp8Ratio(
                        r.kernel,
                        plain,
                        r.page_bytes,
                        r.blocks,
                        r.layers,
                        r.pattern,
                        r.rows,
                        other.seconds / r.seconds,
                        r.method,
                        r.programs,
                    )
                )
    return ratios


def print_trimmed_summary(results: Sequence[Result]) -> None:
    """One line per page size and kernel: each plain method as a fraction of one contiguous copy, and the fastest."""
    shown = ("triton", "triton-p32", "dma", "dma-2d")
    print(f"\nper page size: x contiguous (1.0 = the copy engine's ceiling); the fastest of {', '.join(shown)}")
    for kernel in ("gather", "scatter"):
        for size in sorted({r.page_bytes for r in results}):
            by = {r.method: r for r in results if r.kernel == kernel and r.page_bytes == size and r.method in shown}
            if not by:
                continue
            cells = "  ".join(
                f"{method} {by[method].vs_contiguous:.2f}"
                if method in by and by[method].vs_contiguous is not None
                else f"{method} -"
                for method in shown
            )
            fastest = min(by.values(), key=lambda r: r.seconds).method
            print(f"  {kernel:7s} {readable_bytes(size):>7s}: {cells}  -> {fastest}")


if __name__ == "__main__":
    raise SystemExit(main())
