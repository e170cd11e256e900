"""A real vLLM request flow with kvtriton in place: vLLM's v1 Scheduler and OffloadingConnector, on CPU.

The scheduler and both sides of the connector are vLLM's own; only the model
is simulated: it writes a known pattern into the KV blocks of the tokens it
computes. A prompt is offloaded after its prefill; once the GPU prefix cache is
reset, the same prompt is served from kvtriton's host slab, and the loaded
blocks must hold the original bytes. For hybrid models and padded pages every
job kvtriton ran is also replayed through vLLM's own CPU worker (run on CPU,
see ``vllm_fixtures/vllm_cpu_worker.py``), which must report the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from unittest import mock

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs it from requirements-vllm.txt)")

import torch
from vllm.config import ModelConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm_fixtures.builders import SPEC_EXTRA_CONFIG
from vllm_fixtures.connector import submit_load, submit_store
from vllm_fixtures.in_process import (
    BLOCK_SIZE,
    NUM_GPU_BLOCKS,
    InProcessVLLM,
    offloading_manager,
    start_in_process_vllm,
)
from vllm_fixtures.requests import make_request
from vllm_fixtures.vllm_cpu_worker import vllm_cpu_worker

from kvtriton.integrations.vllm import KVTritonOffloadingSpec, VLLMOffloadingManager, VLLMOffloadingWorker
from kvtriton.integrations.vllm._surface import DeviceSide, load_arguments, store_arguments
from kvtriton.manager import CPUOffloadingManager

LAYERS = ("layer0", "layer1")
KV_SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float16)
WINDOW_SPEC = SlidingWindowSpec(
    block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=32
)
PADDING_BYTES = 64
PADDED_SPEC = FullAttentionSpec(
    block_size=BLOCK_SIZE,
    num_kv_heads=2,
    head_size=8,
    dtype=torch.float16,
    page_size_padded=KV_SPEC.page_size_bytes + PADDING_BYTES,
)
"""Each block's page is padded by 64 bytes the model never writes (as vLLM pads pages to a common size)."""
ONE_GROUP: list[tuple[list[str], KVCacheSpec]] = [(list(LAYERS), KV_SPEC)]
HYBRID: list[tuple[list[str], KVCacheSpec]] = [(["layer0"], KV_SPEC), (["layer1"], WINDOW_SPEC)]
"""A full-attention group and a sliding-window group (2 blocks), one layer each: each group owns its own tensor."""
PADDED: list[tuple[list[str], KVCacheSpec]] = [(list(LAYERS), PADDED_SPEC)]
PADDING_MARKER = 0x5A


@dataclass(frozen=True)
class SubmittedJob:
    """One job as vLLM's connector handed it to the worker."""

    kind: Literal["store", "load"]
    job_id: int
    gpu: GPULoadStoreSpec
    slots: LoadStoreSpec
    expedited: bool = False


class RecordingWorker(OffloadingWorker):
    """Passes every call to kvtriton's worker and records the jobs and their reported sizes."""

    def __init__(self, inner: OffloadingWorker) -> None:
        self.inner = inner
        self.jobs: list[SubmittedJob] = []
        self.sizes: dict[int, int | None] = {}

    def _blocks(self, device: DeviceSide) -> GPULoadStoreSpec:
        """The job's block ids, whichever contract the installed vLLM's connector called with (see the worker)."""
        assert isinstance(self.inner, VLLMOffloadingWorker)
        blocks = self.inner.device_blocks(device)
        return GPULoadStoreSpec(blocks.block_ids.tolist(), list(blocks.group_sizes), list(blocks.block_indices))

    def submit_store(self, *args: Any, **kwargs: Any) -> bool:
        job_id, device, slots = store_arguments(args, kwargs)
        self.jobs.append(SubmittedJob("store", job_id, self._blocks(device), slots))
        return self.inner.submit_store(*args, **kwargs)

    def submit_load(self, *args: Any, **kwargs: Any) -> bool:
        job_id, slots, device, expedited = load_arguments(args, kwargs)
        self.jobs.append(SubmittedJob("load", job_id, self._blocks(device), slots, expedited))
        return self.inner.submit_load(*args, **kwargs)

    def get_finished(self) -> list[TransferResult]:
        results = self.inner.get_finished()
        self.sizes.update((result.job_id, result.transfer_size) for result in results)
        return results

    def wait(self, job_ids: set[int]) -> None:
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        self.inner.shutdown()


@dataclass(kw_only=True)
class Engine(InProcessVLLM):
    """The in-process vLLM with kvtriton's spec, one rank, and a simulated model writing known patterns."""

    kv: dict[str, torch.Tensor]
    """Each layer's KV cache as the model sees it (its real bytes: without page padding)."""
    pages: dict[str, torch.Tensor]
    """Each layer's whole int8 ``(num_blocks, page_size_bytes)`` pages, padding included."""
    groups: list[list[str]]
    """The layer names of each KV cache group."""
    recorder: RecordingWorker
    canonical: CanonicalKVCaches
    """The canonical KV caches vLLM's connector handed kvtriton's spec."""
    # (group, prompt block index) -> bytes the model wrote for it (one pattern per layer of the group)
    written: dict[tuple[int, int], list[bytes]] = field(default_factory=lambda: {})

    @property
    def worker(self) -> OffloadingConnector:
        (worker,) = self.workers
        return worker

    @property
    def kvtriton_worker(self) -> VLLMOffloadingWorker:
        assert isinstance(self.recorder.inner, VLLMOffloadingWorker)
        return self.recorder.inner

    @property
    def manager(self) -> VLLMOffloadingManager:
        return offloading_manager(self.scheduler, VLLMOffloadingManager)

    def cpu_manager(self) -> CPUOffloadingManager:
        return self.manager.cpu

    def block_bytes(self, block: int, group: int = 0) -> list[bytes]:
        return [self.kv[name][block].numpy().tobytes() for name in self.groups[group]]

    def compute(self, output: SchedulerOutput, model_request: str) -> None:
        """The model: write a pattern into the blocks of ``model_request``'s newly scheduled full blocks."""
        scheduled = output.num_scheduled_tokens.get(model_request, 0)
        if not scheduled:
            return
        request = self.scheduler.requests[model_request]
        end = request.num_computed_tokens + scheduled
        for group, names in enumerate(self.groups):
            for index, block in enumerate(self.gpu_blocks(model_request, group)[: end // BLOCK_SIZE]):
                if block == 0 or (group, index) in self.written:
                    continue
                for name in names:
                    generator = torch.Generator().manual_seed(1000 * index + LAYERS.index(name))
                    pattern = torch.randint(
                        -(2**15), 2**15, self.kv[name][block].shape, generator=generator, dtype=torch.int32
                    )
                    self.kv[name][block].copy_(pattern.to(torch.int16).view(torch.float16))
                self.written[group, index] = self.block_bytes(block, group)

    def step_model(self, model_request: str = "") -> SchedulerOutput:
        """One engine step whose model computes ``model_request``'s blocks (none when empty)."""
        return self.step(lambda output: self.compute(output, model_request))

    def run(self, model_request: str = "", max_steps: int = 10) -> None:
        """Step until no request is left and every transfer has been reported."""
        for _ in range(max_steps):
            self.step_model(model_request)
            if not self.scheduler.requests and not self.scheduler.has_unfinished_requests():
                self.step()  # one more step delivers the last store completions
                return
        raise AssertionError(f"requests still running after {max_steps} steps")


def make_engine(
    model_config: ModelConfig,
    extra_config: dict[str, object],
    groups: list[tuple[list[str], KVCacheSpec]] = ONE_GROUP,
) -> Engine:
    # FlashInfer-style (num_blocks, 2, block_size, heads, dim) layer caches, as a CPU "GPU"; a padded
    # page is a view into a wider per-block buffer whose padding holds a marker.
    pages: dict[str, torch.Tensor] = {}
    kv: dict[str, torch.Tensor] = {}
    for names, spec in groups:
        for name in names:
            pages[name] = torch.full((NUM_GPU_BLOCKS, spec.page_size_bytes), PADDING_MARKER, dtype=torch.int8)
            real = pages[name][:, : KV_SPEC.page_size_bytes]
            real.zero_()
            kv[name] = real.view(torch.float16).view(NUM_GPU_BLOCKS, 2, BLOCK_SIZE, 2, 8)
    handed: list[CanonicalKVCaches] = []
    get_worker = KVTritonOffloadingSpec.get_worker

    def recording_get_worker(spec: KVTritonOffloadingSpec, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        handed.append(kv_caches)
        return get_worker(spec, kv_caches)

    with mock.patch.object(KVTritonOffloadingSpec, "get_worker", recording_get_worker):
        scheduler, workers = start_in_process_vllm(
            model_config,
            {**SPEC_EXTRA_CONFIG, **extra_config},
            [KVCacheGroupSpec(names, spec) for names, spec in groups],
            lambda rank: kv,
        )
    connector = workers[0].connector_worker
    assert connector is not None and connector.worker is not None
    recorder = RecordingWorker(connector.worker)
    connector.worker = recorder
    return Engine(
        scheduler=scheduler,
        workers=workers,
        aggregator=KVOutputAggregator(1),
        kv=kv,
        pages=pages,
        groups=[names for names, _ in groups],
        recorder=recorder,
        canonical=handed[0],
    )


def replay_on_vllms_cpu_worker(engine: Engine) -> dict[int, int | None]:
    """Run every job kvtriton ran through vLLM's own CPU worker over the same KV caches; its reported sizes.

    The loads write the GPU blocks again: call it once the test has checked them.
    """
    connector = engine.worker.connector_worker
    assert connector is not None and isinstance(connector.spec, KVTritonOffloadingSpec)
    sizes: dict[int, int | None] = {}
    with vllm_cpu_worker(engine.canonical, connector.spec.blocks_per_chunk, connector.spec.num_slots) as reference:
        for job in engine.recorder.jobs:
            if job.kind == "store":
                assert submit_store(reference, engine.canonical, job.job_id, job.gpu, job.slots)
            else:
                assert submit_load(reference, engine.canonical, job.job_id, job.slots, job.gpu, expedited=job.expedited)
            sizes.update((result.job_id, result.transfer_size) for result in reference.get_finished())
    return sizes


class NewEngine(Protocol):
    def __call__(
        self, extra_config: dict[str, object], groups: list[tuple[list[str], KVCacheSpec]] = ..., /
    ) -> Engine: ...


@pytest.fixture
def new_engine(model_config: ModelConfig) -> Iterator[NewEngine]:
    """``new_engine(extra_config, groups=ONE_GROUP)``: :func:`make_engine` on the module's model, shut down after
    the test."""
    made: list[Engine] = []

    def new(extra_config: dict[str, object], groups: list[tuple[list[str], KVCacheSpec]] = ONE_GROUP, /) -> Engine:
        made.append(make_engine(model_config, extra_config, groups))
        return made[-1]

    yield new
    for engine in made:
        engine.shutdown()


PAGE_BYTES = KV_SPEC.page_size_bytes


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_a_repeated_prompt_is_loaded_from_the_host_slab_bit_exact(new_engine: NewEngine, blocks_per_chunk: int) -> None:
    engine = new_engine(
        {"cpu_bytes_to_use": 8 * blocks_per_chunk * PAGE_BYTES * len(LAYERS), "blocks_per_chunk": blocks_per_chunk}
    )
    assert len(engine.kvtriton_worker.engines) == 1  # one group referencing every tensor: one engine, no split

    prompt = list(range(100, 100 + 4 * BLOCK_SIZE + 5))  # 4 full blocks and a partial one
    engine.scheduler.add_request(make_request("first", prompt))
    engine.run(model_request="first")
    assert engine.store_jobs and not engine.load_jobs
    stats = engine.cpu_manager().stats()
    assert (stats.stores, stats.pending) == (4 // blocks_per_chunk, 0)  # every full chunk stored, all complete

    assert engine.scheduler.reset_prefix_cache()  # the GPU prefix cache forgets the prompt ...
    for tensor in engine.kv.values():
        tensor.zero_()  # ... and its blocks are overwritten

    engine.scheduler.add_request(make_request("second", prompt))
    first_step = engine.step()
    assert len(engine.load_jobs) == 1
    loaded_blocks = engine.gpu_blocks("second")[:4]
    engine.run()
    assert first_step.num_scheduled_tokens.get("second", 0) == 0  # waits for its async load
    assert [engine.block_bytes(block) for block in loaded_blocks] == [engine.written[0, index] for index in range(4)]
    stats = engine.cpu_manager().stats()
    assert (stats.hits, stats.loading) == (4 // blocks_per_chunk, 0)


def test_a_sync_load_runs_on_the_engines_expedited_lane_within_the_step(new_engine: NewEngine) -> None:
    # With a sync-load budget vLLM loads a hit within the step that schedules
    # it and waits for it there: kvtriton must not queue it behind other loads.
    engine = new_engine({"cpu_bytes_to_use": 8 * PAGE_BYTES * len(LAYERS), "sync_load_budget_bytes": 1 << 30})
    prompt = list(range(1100, 1100 + 4 * BLOCK_SIZE + 5))
    engine.scheduler.add_request(make_request("first", prompt))
    engine.run(model_request="first")
    assert engine.scheduler.reset_prefix_cache()
    for tensor in engine.kv.values():
        tensor.zero_()

    (transfer_engine,) = engine.kvtriton_worker.engines
    with mock.patch.object(transfer_engine, "submit_load", wraps=transfer_engine.submit_load) as submit_load:
        engine.scheduler.add_request(make_request("second", prompt))
        first_step = engine.step()
    (load,) = [job for job in engine.recorder.jobs if job.kind == "load"]
    assert load.expedited
    assert submit_load.call_count == 1 and submit_load.call_args.kwargs["expedited"] is True
    assert first_step.num_scheduled_tokens["second"] > 0  # computed in the step that loaded it: no waiting
    loaded_blocks = [int(block) for block in load.gpu.block_ids]  # the request already finished and freed them
    assert len(loaded_blocks) == 4
    assert [engine.block_bytes(block) for block in loaded_blocks] == [engine.written[0, index] for index in range(4)]
    engine.run()


def test_a_prompt_seen_once_is_not_stored_with_a_store_threshold(new_engine: NewEngine) -> None:
    engine = new_engine({"cpu_bytes_to_use": 8 * PAGE_BYTES * len(LAYERS), "store_threshold": 2})
    engine.scheduler.add_request(make_request("once", list(range(3 * BLOCK_SIZE))))
    engine.run(model_request="once")
    assert not isinstance(engine.manager.backing, CPUOffloadingManager)  # the reuse filter is in front
    assert engine.cpu_manager().stats().stores == 0
    assert engine.store_jobs == []


def test_with_a_store_threshold_a_prompt_computed_twice_is_stored_whole(new_engine: NewEngine) -> None:
    # vLLM looks keys up only until the first miss, so the filter counts store
    # offers (as vLLM 0.33 does): a prompt is admitted whole on its second
    # computation, not one chunk per repeat.
    engine = new_engine({"cpu_bytes_to_use": 8 * PAGE_BYTES * len(LAYERS), "store_threshold": 2})
    prompt = list(range(300, 300 + 4 * BLOCK_SIZE))
    engine.scheduler.add_request(make_request("first", prompt))
    engine.run(model_request="first")
    assert engine.cpu_manager().stats().stores == 0

    assert engine.scheduler.reset_prefix_cache()
    engine.scheduler.add_request(make_request("second", prompt))
    engine.run(model_request="second")
    stats = engine.cpu_manager().stats()
    assert (stats.stores, stats.pending) == (4, 0)


@pytest.mark.parametrize("blocks_per_chunk", [1, 4])
def test_a_hybrid_model_loads_its_full_prefix_and_its_sliding_window_bit_exact(
    new_engine: NewEngine, blocks_per_chunk: int
) -> None:
    # Two KV cache groups: GPU specs carry group_sizes, and the window group's
    # load starts at its block 4 (blocks_per_chunk=1) or half-way into its
    # first chunk (blocks_per_chunk=4, block_indices=[0, 2]).
    engine = new_engine(
        {"cpu_bytes_to_use": 64 * blocks_per_chunk * PAGE_BYTES, "blocks_per_chunk": blocks_per_chunk},
        HYBRID,
    )
    prompt = list(range(500, 500 + 6 * BLOCK_SIZE + 5))
    engine.scheduler.add_request(make_request("first", prompt))
    engine.run(model_request="first")
    assert engine.store_jobs and not engine.load_jobs

    assert engine.scheduler.reset_prefix_cache()
    for tensor in engine.kv.values():
        tensor.zero_()
    engine.scheduler.add_request(make_request("second", prompt))
    engine.step()
    assert len(engine.load_jobs) == 1
    full_blocks = engine.gpu_blocks("second", 0)
    window_blocks = engine.gpu_blocks("second", 1)
    engine.run()

    full_chunks = 6 // blocks_per_chunk * blocks_per_chunk  # whole chunks of the 6 full blocks
    assert [engine.block_bytes(block, 0) for block in full_blocks[:full_chunks]] == [
        engine.written[0, index] for index in range(full_chunks)
    ]
    window = [(index, block) for index, block in enumerate(window_blocks[:full_chunks]) if block != 0]
    assert [index for index, _ in window] == [full_chunks - 2, full_chunks - 1]  # the last 32 tokens
    assert [engine.block_bytes(block, 1) for _, block in window] == [engine.written[1, index] for index, _ in window]

    # Each group owns its own tensor: its blocks move that tensor only, so
    # every other block of both tensors is still zero.
    assert len(engine.kvtriton_worker.engines) == 2
    loaded = {"layer0": set(full_blocks[:full_chunks]), "layer1": {block for _, block in window}}
    for name, blocks in loaded.items():
        untouched = [block for block in range(NUM_GPU_BLOCKS) if block not in blocks]
        assert not engine.kv[name][untouched].any(), f"{name}: a block of the other group was written"
    # A block of either group is one page of one layer.
    loads = [job for job in engine.recorder.jobs if job.kind == "load"]
    assert [engine.recorder.sizes[job.job_id] for job in loads] == [
        len(job.gpu.block_ids) * PAGE_BYTES for job in loads
    ]
    assert engine.recorder.sizes == replay_on_vllms_cpu_worker(engine)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_padded_pages_move_only_their_real_bytes_bit_exact(new_engine: NewEngine, blocks_per_chunk: int) -> None:
    engine = new_engine(
        {
            "cpu_bytes_to_use": 8 * blocks_per_chunk * PADDED_SPEC.page_size_bytes * len(LAYERS),
            "blocks_per_chunk": blocks_per_chunk,
        },
        PADDED,
    )
    real_row = PAGE_BYTES * len(LAYERS)
    assert engine.kvtriton_worker.engines[0].slab.row_bytes == real_row  # the slab holds no padding
    prompt = list(range(900, 900 + 4 * BLOCK_SIZE + 3))
    engine.scheduler.add_request(make_request("first", prompt))
    engine.run(model_request="first")
    stores = [job for job in engine.recorder.jobs if job.kind == "store"]
    assert stores and [engine.recorder.sizes[job.job_id] for job in stores] == [
        len(job.gpu.block_ids) * real_row for job in stores
    ]

    assert engine.scheduler.reset_prefix_cache()
    other_marker = 0x33
    for page in engine.pages.values():
        page.fill_(other_marker)  # real bytes and padding alike
    engine.scheduler.add_request(make_request("second", prompt))
    engine.step()
    loaded_blocks = engine.gpu_blocks("second")[:4]
    engine.run()
    assert [engine.block_bytes(block) for block in loaded_blocks] == [engine.written[0, index] for index in range(4)]
    for name, page in engine.pages.items():
        # Had the padding travelled, the loaded blocks would hold the first run's marker there.
        padding = page[loaded_blocks, PAGE_BYTES:]
        assert bool((padding == other_marker).all()), f"{name}: padding was copied"
    assert engine.recorder.sizes == replay_on_vllms_cpu_worker(engine)


def test_a_connector_cache_reset_with_stores_in_flight_forgets_every_chunk_and_stores_them_again(
    new_engine: NewEngine,
) -> None:
    engine = new_engine({"cpu_bytes_to_use": 8 * PAGE_BYTES * len(LAYERS)})
    prompt = list(range(700, 700 + 3 * BLOCK_SIZE + 1))
    engine.scheduler.add_request(make_request("first", prompt))
    while engine.scheduler.has_unfinished_requests():
        engine.step_model("first")
    # The request is done but its store job only reaches the worker next step:
    # the reset flushes it, and vLLM drops its late completion.
    assert engine.cpu_manager().stats().pending == 3
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.step()
    assert engine.cpu_manager().stats().used == 0

    engine.scheduler.add_request(make_request("second", prompt))
    engine.run(model_request="second")
    assert engine.load_jobs == []  # nothing survived the reset
    stats = engine.cpu_manager().stats()
    assert (stats.used, stats.pending, stats.loading) == (3, 0, 0)
    assert sorted(engine.cpu_manager().slot_map().values()) == [0, 1, 2]  # the slots were handed out afresh
