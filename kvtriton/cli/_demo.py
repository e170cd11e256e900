"""`kvtriton demo`: offload a model-shaped KV cache through the manager and the engine.

Builds a paged KV cache with a real model's geometry (Llama-3-8B by default,
scaled down in block count to fit a CPU machine), replays requests that
share a few system prompts (the ``shared-prompt`` workload) through
``CPUOffloadingManager`` + ``TransferEngine`` -- look up each prompt's
chunks, load the hits into freshly allocated GPU blocks, "compute" the rest,
store every new chunk, evicting under pressure -- and checks every loaded
block bit for bit against what was stored. Exits 1 on any mismatch or failed
job, and when no load happened at all (nothing was checked).

``--compression fp8-e4m3`` (lossy) stores the slab rows compressed: a loaded
block then holds the dequantized values, so each one is checked bit for bit
against what the torch reference (``gather_pages_reference`` then
``scatter_pages_reference``, with the compression layout) makes of the stored block, and the
report adds the bytes moved against uncompressed rows, the slots the same
``--capacity`` buys, and the element error against the original values.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtriton._byte_units import BARE_NUMBER_UNIT, SIZE_RULE, format_bytes, is_bare_number, parse_capacity
from kvtriton.cli._main import add_choice_argument, command_error
from kvtriton.manager.policies import policy_names
from kvtriton.sim import PRESETS, ModelGeometry

if TYPE_CHECKING:
    import torch

    from kvtriton._keys import OffloadKey
    from kvtriton._offload_types import ReqContext
    from kvtriton.kernels import KVCompression
    from kvtriton.manager import CPUOffloadingManager
    from kvtriton.sim import Request
    from kvtriton.worker import PagedKV, TransferEngine, TransferResult

LAYOUTS = ("flash_attn", "flashinfer", "mla", "cross_layer", "pages")
COMPRESSIONS = ("none", "fp8-e4m3")
BACKENDS = ("auto", "triton", "dma", "torch")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_CAPACITY = "96MiB"
"""The host slab of ``make demo``: 48 Llama-3-8B blocks, small enough for any CPU machine."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.epilog = (
        "exit status: 0 when every loaded block matched what was stored; 1 on a mismatch, a failed job, or a run"
        " that loaded nothing (so checked nothing); 2 on settings that cannot run"
    )
    add_choice_argument(
        parser,
        "--model",
        sorted(PRESETS),
        default="llama-3-8b",
        help="KV geometry preset (layers, KV heads, head dim; bf16, 16-token blocks)",
    )
    add_choice_argument(
        parser,
        "--layout",
        ("auto", *LAYOUTS),
        default="auto",
        help="engine KV cache layout to build; auto: mla for an MLA model (deepseek-v3), else flash_attn",
    )
    add_choice_argument(
        parser,
        "--compression",
        COMPRESSIONS,
        default="none",
        help="slab row format: none (bit-exact copies) or fp8-e4m3 (lossy: fp8 codes plus one fp32"
        " scale per head-dim group, about half the bytes; loads are checked against the torch reference)",
    )
    add_choice_argument(parser, "--policy", policy_names(), default="lru", help="manager eviction policy")
    parser.add_argument(
        "--capacity",
        default=DEFAULT_CAPACITY,
        metavar="SIZE",
        help=f"host slab size, vLLM's cpu_bytes_to_use ({SIZE_RULE})",
    )
    parser.add_argument("--gpu-blocks", type=int, default=64, help="GPU KV cache size in blocks (scaled down for CPU)")
    add_choice_argument(
        parser, "--backend", BACKENDS, default="auto", help="copy backend; auto = triton on CUDA, torch on CPU"
    )
    parser.add_argument("--block-size-factor", type=int, default=1, help="GPU blocks per offloaded block (slot)")
    parser.add_argument("--requests", type=int, default=40, help="number of requests to replay")
    parser.add_argument("--seed", type=int, default=0, help="workload and content seed")
    add_choice_argument(
        parser,
        "--device",
        DEVICES,
        default="auto",
        help="where the 'GPU' cache lives: auto (cuda if available), cuda, cpu",
    )
    parser.add_argument(
        "--allow-pageable",
        action="store_true",
        help="when the slab cannot be pinned (RLIMIT_MEMLOCK too low), run on a slower pageable slab"
        " instead of stopping",
    )
    parser.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")


def default_layout(geometry: ModelGeometry) -> str:
    """The layout a server would use for ``geometry``: MLA's one latent per token, else FlashAttention's K and V."""
    return "mla" if geometry.kv_factor == 1 else "flash_attn"


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """The validated demo settings."""

    geometry: ModelGeometry
    layout: str
    compression: KVCompression
    policy: str
    capacity_bytes: int
    capacity_text: str
    """``--capacity`` as given, for messages."""
    gpu_blocks: int
    backend: str
    block_size_factor: int
    requests: int
    seed: int
    device: str
    allow_pageable: bool
    progress: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoConfig:
        from kvtriton.kernels import KVCompression

        geometry = PRESETS[str(args.model)]
        layout = default_layout(geometry) if args.layout == "auto" else str(args.layout)
        if layout in ("flash_attn", "flashinfer") and geometry.kv_factor != 2:
            raise ValueError(f"--layout {layout} splits K and V, but {geometry.name} caches one latent (use mla)")
        if layout == "mla" and geometry.kv_factor != 1:
            mla_models = ", ".join(name for name, preset in PRESETS.items() if preset.kv_factor == 1)
            raise ValueError(
                f"--layout mla caches one latent per token, but --model {geometry.name} caches K and V"
                f" (use flash_attn, flashinfer, cross_layer or pages, or an MLA model: {mla_models})"
            )
        for name in ("gpu_blocks", "block_size_factor", "requests"):
            value = int(getattr(args, name))
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        compression = KVCompression.parse(str(args.compression), "--compression")
        if compression is KVCompression.FP8_E4M3 and layout == "pages":
            raise ValueError(
                "--compression fp8-e4m3 compresses bf16/fp16/fp32 pages, but --layout pages hands the engine int8 byte"
                " views, which pass through uncompressed (pick another --layout)"
            )
        capacity_text = str(args.capacity)
        try:
            capacity_bytes = parse_capacity(capacity_text)
        except ValueError as error:
            raise ValueError(f"--capacity: {error}") from None
        return cls(
            geometry=geometry,
            layout=layout,
            compression=compression,
            policy=str(args.policy),
            capacity_bytes=capacity_bytes,
            capacity_text=capacity_text,
            gpu_blocks=int(args.gpu_blocks),
            backend=str(args.backend),
            block_size_factor=int(args.block_size_factor),
            requests=int(args.requests),
            seed=int(args.seed),
            device=str(args.device),
            allow_pageable=bool(args.allow_pageable),
            progress=not bool(args.no_progress),
        )


def build_cache(geometry: ModelGeometry, layout: str, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """Zeroed engine tensors of ``geometry`` in ``layout`` (bf16 elements; int8 byte views for ``pages``)."""
    import torch

    g = geometry
    heads, dim, bs, layers, kv = g.num_kv_heads, g.head_dim, g.block_size, g.num_layers, g.kv_factor
    dtype = torch.bfloat16

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    if layout == "flash_attn":
        return [zeros(2, num_blocks, bs, heads, dim) for _ in range(layers)]
    if layout == "flashinfer":
        return [zeros(num_blocks, 2, bs, heads, dim) for _ in range(layers)]
    if layout == "mla":
        return [zeros(num_blocks, bs, kv * heads * dim) for _ in range(layers)]
    if layout == "cross_layer":
        return [zeros(num_blocks, layers, kv, bs, heads, dim)]
    page_bytes = kv * bs * heads * dim * dtype.itemsize
    return [torch.zeros((num_blocks, page_bytes), dtype=torch.int8, device=device) for _ in range(layers)]


@dataclass(slots=True)
class ElementError:
    """The element error of compressed loads against the original values, over every checked block."""

    elements: int = 0
    max_abs: float = 0.0
    sum_abs: float = 0.0
    sum_abs_value: float = 0.0
    """Sum of ``|x|`` over the same elements, to put the mean error in proportion."""

    def add(self, original: torch.Tensor, decoded: torch.Tensor) -> None:
        error = (original.float() - decoded.float()).abs()
        self.elements += error.numel()
        self.max_abs = max(self.max_abs, float(error.max()))
        self.sum_abs += float(error.double().sum())
        self.sum_abs_value += float(original.float().abs().double().sum())


class BlockContent:
    """Deterministic bytes for every block hash: a slice of one random pool plus a unique stamp per page.

    Slicing a pool costs a memcpy instead of generating random bytes per
    block; the stamp (the block's serial number in each page) makes any two
    blocks differ, so a load from the wrong slot cannot pass the check.

    Uncompressed, the pool is random bytes (any bit pattern must survive) and
    the stamp is the serial's 8 bytes. Compressed, both must be values the
    format takes: the pool is normal-distributed elements of the page dtype
    (fp8-e4m3 refuses NaN and infinity), and the stamp is the serial's 32 bits
    as +1 / -1 in the first elements of each page, signs that survive
    quantization, so two blocks still differ after it.
    """

    _SPREAD = 4096
    _STAMP_BITS = 32

    def __init__(self, kv: PagedKV, seed: int) -> None:
        import torch

        from kvtriton.kernels import KVCompression

        generator = torch.Generator().manual_seed(seed)
        self.kv = kv
        self.pages = kv.byte_pages()
        self.compressed = kv.compression is KVCompression.FP8_E4M3
        size = kv.raw_row_bytes + self._SPREAD
        if self.compressed:
            dtype = kv.pages[0].dtype  # the demo builds every page tensor in one dtype
            elements = -(-size // dtype.itemsize)
            values = torch.randn(elements, generator=generator).to(dtype)
            self.pool = values.view(torch.uint8)[:size]
        else:
            self.pool = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        self.pool = self.pool.to(kv.device)
        self.serials: dict[bytes, int] = {}
        self.error = ElementError()

    def _stamp(self, serial: int, page: torch.Tensor) -> torch.Tensor:
        import torch

        if not self.compressed:
            return torch.tensor(list(serial.to_bytes(8, "little")), dtype=torch.uint8, device=page.device)
        bits = torch.tensor([(serial >> bit) & 1 for bit in range(self._STAMP_BITS)], device=page.device)
        return (bits.to(page.dtype) * 2 - 1).view(torch.uint8)

    def row(self, block_hash: bytes) -> torch.Tensor:
        """The block's original bytes, one uncompressed row (``kv.raw_row_bytes``)."""
        serial = self.serials.setdefault(block_hash, len(self.serials))
        start = (serial * 64) % self._SPREAD
        row = self.pool[start : start + self.kv.raw_row_bytes].clone()
        for page, offset, size in zip(self.kv.pages, self.kv.page_offsets, self.kv.page_bytes):
            stamp = self._stamp(serial, page)
            width = min(stamp.numel(), size)
            row[offset : offset + width] = stamp[:width]
        return row

    def expected(self, block_hash: bytes) -> torch.Tensor:
        """What a load of the block must write: its bytes, or with compression the torch reference's round trip.

        The reference quantizes one block into a compressed row and
        dequantizes it back, the arithmetic the engine's kernels match bit for
        bit; the element error against the original is recorded on the way.
        """
        import torch

        from kvtriton.kernels import compression_layout, gather_pages_reference, scatter_pages_reference
        from kvtriton.worker import byte_view

        row = self.row(block_hash)
        layout = self.kv.compression_layout
        if layout is None:
            return row
        device = self.kv.device
        original = [torch.empty((1, *page.shape[1:]), dtype=page.dtype, device=device) for page in self.kv.pages]
        for page, offset, size in zip(original, self.kv.page_offsets, self.kv.page_bytes):
            byte_view(page)[0].copy_(row[offset : offset + size])
        compressed = torch.empty((1, self.kv.row_bytes), dtype=torch.uint8, device=device)
        decoded = [torch.empty_like(page) for page in original]
        index = torch.zeros(1, dtype=torch.int64, device=device)
        block_layout = compression_layout(original, [page.group_size for page in layout.pages])
        gather_pages_reference(original, compressed, index, index, compression=block_layout)
        scatter_pages_reference(compressed, decoded, index, index, compression=block_layout)
        for before, after in zip(original, decoded):
            self.error.add(before, after)
        return torch.cat([byte_view(page)[0] for page in decoded])

    def write(self, block: int, block_hash: bytes) -> None:
        row = self.row(block_hash)
        for page, offset, size in zip(self.pages, self.kv.page_offsets, self.kv.page_bytes):
            page[block].copy_(row[offset : offset + size])

    def matches(self, block: int, block_hash: bytes) -> bool:
        import torch

        row = self.expected(block_hash)
        return all(
            torch.equal(page[block], row[offset : offset + size])
            for page, offset, size in zip(self.pages, self.kv.page_offsets, self.kv.page_bytes)
        )


@dataclass(slots=True)
class DemoStats:
    """What the run did; ``ok`` when every loaded block matched and no job failed."""

    requests: int = 0
    prompt_chunks: int = 0
    hit_chunks: int = 0
    load_jobs: int = 0
    store_jobs: int = 0
    stores_refused: int = 0
    failed_jobs: int = 0
    evicted: int = 0
    loaded_blocks: int = 0
    stored_blocks: int = 0
    mismatched_blocks: int = 0
    truncated_requests: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    wall_seconds: float = 0.0
    mismatches: list[str] = field(default_factory=lambda: [])

    @property
    def ok(self) -> bool:
        """Every loaded block matched, no job failed, and at least one load was checked."""
        return self.mismatched_blocks == 0 and self.failed_jobs == 0 and self.loaded_blocks > 0

    def record(self, result: TransferResult) -> None:
        if not result.success:
            self.failed_jobs += 1
        elif result.transfer_type == ("CPU", "GPU"):
            self.bytes_loaded += result.transfer_size
            self.load_seconds += result.transfer_time
        else:
            self.bytes_stored += result.transfer_size
            self.store_seconds += result.transfer_time


def _rate(size: int, seconds: float) -> str:
    """Bandwidth in GB/s (10^9 bytes per second), the unit of every benchmark in bench/."""
    return f"{size / seconds / 1e9:.2f} GB/s" if seconds > 0 else "n/a"


class DemoServer:
    """Replays requests against one manager + engine pair, as vLLM's connector would drive them."""

    def __init__(self, config: DemoConfig, kv: PagedKV, manager: CPUOffloadingManager, engine: TransferEngine) -> None:
        import random

        self.config = config
        self.kv = kv
        self.manager = manager
        self.engine = engine
        self.content = BlockContent(kv, config.seed)
        self.stats = DemoStats()
        blocks = list(range(config.gpu_blocks))
        random.Random(config.seed).shuffle(blocks)
        self.free_blocks: deque[int] = deque(blocks)
        self.chunks_per_step = max(1, manager.capacity // 4)
        self._next_job = 0

    def _finish(self, job_id: int) -> TransferResult:
        self.engine.wait({job_id})
        finished = {result.job_id: result for result in self.engine.get_finished()}
        result = finished[job_id]
        self.stats.record(result)
        return result

    def _job_id(self) -> int:
        self._next_job += 1
        return self._next_job

    def serve(self, request: Request) -> None:
        from kvtriton._keys import make_offload_key
        from kvtriton._offload_types import GPULoadStoreSpec, LookupResult, ReqContext

        f = self.config.block_size_factor
        ctx = ReqContext(req_id=request.req_id)
        hashes = list(request.prompt_blocks + request.output_blocks)
        if len(hashes) > self.config.gpu_blocks:
            hashes = hashes[: self.config.gpu_blocks]
            self.stats.truncated_requests += 1
        # One key per offloaded chunk of f blocks: the hash of its last block (vLLM's convention).
        chunk_keys: list[OffloadKey] = [make_offload_key(hashes[c * f + f - 1]) for c in range(len(hashes) // f)]
        prompt_chunks = min(len(request.prompt_blocks) // f, len(chunk_keys))
        hits = 0
        for key in chunk_keys[:prompt_chunks]:
            if self.manager.lookup(key, ctx) is not LookupResult.HIT:
                break
            hits += 1
        self.manager.touch(chunk_keys[:prompt_chunks], ctx)
        self.stats.requests += 1
        self.stats.prompt_chunks += prompt_chunks
        self.stats.hit_chunks += hits

        gpu = [self.free_blocks.popleft() for _ in hashes]
        loaded = hits * f
        if hits:
            spec = self.manager.prepare_load(chunk_keys[:hits], ctx)
            job = self._job_id()
            if self.engine.submit_load(job, spec, GPULoadStoreSpec(gpu[:loaded])):
                self.stats.load_jobs += 1
                result = self._finish(job)
                if result.success:
                    self.stats.loaded_blocks += loaded
                    for index in range(loaded):
                        if not self.content.matches(gpu[index], hashes[index]):
                            self.stats.mismatched_blocks += 1
                            self.stats.mismatches.append(f"{request.req_id} block {index} (GPU block {gpu[index]})")
            else:
                self.stats.failed_jobs += 1
            self.manager.complete_load(chunk_keys[:hits], ctx)
        for index in range(loaded, len(hashes)):
            self.content.write(gpu[index], hashes[index])  # the model computes what did not hit

        # Store step by step, as a server stores each prefill step's new chunks.
        position = {key: chunk for chunk, key in enumerate(chunk_keys)}
        for first in range(0, len(chunk_keys), self.chunks_per_step):
            self._store(chunk_keys[first : first + self.chunks_per_step], gpu, position, ctx)
        self.free_blocks.extend(gpu)

    def _store(self, keys: list[OffloadKey], gpu: list[int], position: dict[OffloadKey, int], ctx: ReqContext) -> None:
        from kvtriton._offload_types import GPULoadStoreSpec

        f = self.config.block_size_factor
        output = self.manager.prepare_store(keys, ctx)
        if output is None:
            self.stats.stores_refused += 1
            return
        if not output.keys_to_store:
            return
        self.stats.evicted += len(output.evicted_keys)
        blocks = [gpu[position[key] * f + i] for key in output.keys_to_store for i in range(f)]
        job = self._job_id()
        if self.engine.submit_store(job, GPULoadStoreSpec(blocks), output.store_spec):
            self.stats.store_jobs += 1
            result = self._finish(job)
            if result.success:
                self.stats.stored_blocks += len(blocks)
            self.manager.complete_store(output.keys_to_store, ctx, success=result.success)
        else:
            self.stats.failed_jobs += 1
            self.manager.complete_store(output.keys_to_store, ctx, success=False)


def _workload(config: DemoConfig) -> list[Request]:
    """Requests behind a few shared system prompts, sized so one request fits the scaled-down GPU cache."""
    from kvtriton.sim import generate

    bs = config.geometry.block_size
    budget = config.gpu_blocks * bs
    system = max(bs, min(256, budget // 3))
    user_max = max(bs, min(256, budget // 3))
    output = max(1, min(64, budget // 6))
    overrides: dict[str, str | int | float] = {
        "requests": config.requests,
        "system_prompts": 3,
        "system_tokens": system,
        "user_tokens_min": min(32, user_max),
        "user_tokens_max": user_max,
        "output_tokens": output,
    }
    return generate("shared-prompt", seed=config.seed, block_size=bs, overrides=overrides)


def _slots(config: DemoConfig, row_bytes: int) -> int:
    """Host slab slots that ``--capacity`` buys, or a ValueError naming the flag."""
    from kvtriton.worker import HostSlab

    try:
        return HostSlab.slots_for_budget(config.capacity_bytes, config.block_size_factor, row_bytes)
    except ValueError as error:
        raise ValueError(f"--capacity {config.capacity_text}: {error}") from None


def _check_memory(config: DemoConfig, device: torch.device) -> None:
    """Refuse, before allocating anything, a GPU cache on the CPU plus a slab that exceed the available RAM.

    Allocating first would be worse than a traceback: zeroing a cache larger
    than RAM wakes the OOM killer, which may pick another process.
    """
    import kvtriton.worker as worker

    available = worker.mem_available_bytes()
    if available is None:
        return
    block_bytes = config.geometry.bytes_per_block  # the demo's caches are bf16, as the presets are
    slab_bytes = _slots(config, block_bytes) * config.block_size_factor * block_bytes
    cache_bytes = config.gpu_blocks * block_bytes if device.type == "cpu" else 0
    if cache_bytes + slab_bytes > available:
        on_cpu = f"{format_bytes(cache_bytes)} (the 'GPU' cache, on the CPU) + " if cache_bytes else ""
        raise ValueError(
            f"--gpu-blocks {config.gpu_blocks} and --capacity {config.capacity_text} need"
            f" {on_cpu}{format_bytes(slab_bytes)} (host slab) of RAM, but only {format_bytes(available)} is"
            f" available (MemAvailable); lower them{_bare_number_hint(config.capacity_text)}"
        )


def _bare_number_hint(capacity_text: str) -> str:
    """A reminder of the unit rule when ``--capacity`` was a bare number, the likely cause of a huge slab."""
    if not is_bare_number(capacity_text):
        return ""
    return f" (a bare --capacity is {BARE_NUMBER_UNIT}: write e.g. {capacity_text.strip()}MiB for MiB)"


def run(args: argparse.Namespace) -> int:
    import torch

    from kvtriton.cli._progress import progress
    from kvtriton.manager import CPUOffloadingManager
    from kvtriton.worker import HostSlab, PagedKV, SlabPinningError, TransferEngine

    config: DemoConfig | None = None
    try:
        config = DemoConfig.from_args(args)
        device_name = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        if device_name == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch.cuda.is_available() is False")
        device = torch.device(device_name)
        _check_memory(config, device)
        tensors = build_cache(config.geometry, config.layout, config.gpu_blocks, device)
        kv = PagedKV.from_tensors(tensors, layout=config.layout, kv_compression=config.compression)
        slots = _slots(config, kv.row_bytes)
        uncompressed_slots = _slots(config, kv.raw_row_bytes)
        requests = _workload(config)
        # Last in this block: once the slab exists, nothing may fail before `with slab` owns it.
        slab = HostSlab(slots, config.block_size_factor, kv.row_bytes, allow_pageable=config.allow_pageable)
    except ValueError as error:
        return command_error("demo", error)
    except SlabPinningError as error:
        where = f"--capacity {config.capacity_text}: " if config is not None else ""
        return command_error("demo", f"{where}{error} (here: --allow-pageable)")
    except torch.OutOfMemoryError as error:
        where = f"--gpu-blocks {config.gpu_blocks}: " if config is not None else ""
        return command_error("demo", f"{where}{error}")

    print(config.geometry.describe())
    print(
        f"layout {config.layout}: {len(kv.pages)} page tensors, {format_bytes(kv.raw_row_bytes)} per block; "
        f"GPU cache {config.gpu_blocks} blocks ({format_bytes(config.gpu_blocks * kv.raw_row_bytes)}) on {device}"
    )
    if kv.compression_layout is not None:
        print(
            f"compression {config.compression.value}: {format_bytes(kv.row_bytes)} per slab row"
            f" ({kv.row_bytes / kv.raw_row_bytes:.3f}x); {LOSSY_NOTE}"
        )
    with slab:
        manager = CPUOffloadingManager(slots, cache_policy=config.policy)
        try:
            engine = TransferEngine(kv, slab, backend=config.backend)
        except ValueError as error:  # e.g. --backend triton on a slab that could not be pinned
            return command_error("demo", f"--backend {config.backend}: {error}")
        with engine:
            print(
                f"host slab {slots} slots x {config.block_size_factor} blocks = {format_bytes(slab.nbytes)} "
                f"({'pinned' if slab.pinned else 'pageable'}); policy {config.policy}; backend {engine.backend_name}"
            )
            if "triton" in engine.backend_name and device.type == "cpu":
                print(INTERPRETER_NOTE, file=sys.stderr)
            server = DemoServer(config, kv, manager, engine)
            started = time.perf_counter()
            for request in progress(requests, len(requests), "demo", enabled=config.progress):
                server.serve(request)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            server.stats.wall_seconds = time.perf_counter() - started
    _report(server.stats)
    if kv.compression_layout is not None:
        _report_compression(server.stats, server.content.error, kv, slots, uncompressed_slots)
    print(_verdict(server.stats, compressed=kv.compression_layout is not None))
    return 0 if server.stats.ok else 1


INTERPRETER_NOTE = (
    "kvtriton demo: note: --backend triton without a GPU runs the kernels in Triton's interpreter, which executes"
    " them in Python: it checks the kernels' results, but moves a few MB/s, so the rates below are not the"
    " kernels' (use --backend torch for a fast CPU run, a GPU for the kernels' speed)"
)
"""Printed when the demo's Triton kernels run interpreted, so their rates are not read as the kernels' speed."""


LOSSY_NOTE = (
    "LOSSY: loaded blocks hold the dequantized values, not what was stored; each is checked bit for bit against"
    " the torch reference's dequantized bytes"
)
"""Printed with ``--compression fp8-e4m3``, so that nobody reads its OK as a bit-exact round trip."""


def _verdict(stats: DemoStats, *, compressed: bool = False) -> str:
    if stats.mismatched_blocks or stats.failed_jobs:
        return "FAILED"
    if stats.loaded_blocks == 0:
        return (
            "NOTHING VERIFIED: no request found a stored chunk, so no load was checked;"
            " replay more requests (--requests) or give the host slab more room (--capacity)"
        )
    if compressed:
        return "OK: every loaded block matched the torch reference's dequantized bytes (fp8-e4m3, lossy)"
    return "OK: every loaded block matched what was stored"


def _report(stats: DemoStats) -> None:
    hit_rate = stats.hit_chunks / stats.prompt_chunks if stats.prompt_chunks else 0.0
    lines = [
        ("requests", f"{stats.requests} ({stats.truncated_requests} truncated to the GPU cache)"),
        ("hit rate", f"{hit_rate:.1%} ({stats.hit_chunks} of {stats.prompt_chunks} prompt chunks)"),
        (
            "jobs",
            f"{stats.load_jobs} loads, {stats.store_jobs} stores, {stats.failed_jobs} failed, "
            f"{stats.stores_refused} stores refused (no evictable slot)",
        ),
        ("evicted", f"{stats.evicted} chunks"),
        ("loaded", f"{format_bytes(stats.bytes_loaded)} at {_rate(stats.bytes_loaded, stats.load_seconds)}"),
        ("stored", f"{format_bytes(stats.bytes_stored)} at {_rate(stats.bytes_stored, stats.store_seconds)}"),
        ("verified", f"{stats.loaded_blocks} loaded blocks, {stats.mismatched_blocks} mismatched"),
        ("wall time", f"{stats.wall_seconds:.2f} s"),
    ]
    _print_aligned(lines)
    for where in stats.mismatches[:10]:
        print(f"MISMATCH {where}", file=sys.stderr)


def _report_compression(
    stats: DemoStats, error: ElementError, kv: PagedKV, slots: int, uncompressed_slots: int
) -> None:
    """Bytes moved and slots against uncompressed rows, and the element error of the checked loads."""
    moved = stats.bytes_loaded + stats.bytes_stored
    raw = (stats.loaded_blocks + stats.stored_blocks) * kv.raw_row_bytes
    moved_text = (
        f"{format_bytes(moved)} = {moved / raw:.3f}x the {format_bytes(raw)} uncompressed rows" if raw else "none"
    )
    mean = error.sum_abs / error.elements if error.elements else 0.0
    mean_value = error.sum_abs_value / error.elements if error.elements else 0.0
    relative = f" ({mean / mean_value:.2%} of the mean |x| {mean_value:.4g})" if mean_value else ""
    lines = [
        ("bytes moved", f"{moved_text} (loads + stores)"),
        ("slots", f"{slots} for --capacity, {slots / uncompressed_slots:.2f}x the {uncompressed_slots} uncompressed"),
        (
            "element error",
            f"max |x - x'| {error.max_abs:.4g}, mean {mean:.4g}{relative} over {error.elements} elements"
            " of the checked blocks, against the original values",
        ),
    ]
    _print_aligned(lines)
    print(f"note: {LOSSY_NOTE}")


def _print_aligned(lines: list[tuple[str, str]]) -> None:
    """Each ``(name, value)`` on a line, the values aligned after the longest name."""
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
