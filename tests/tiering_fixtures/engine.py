"""vLLM's own Scheduler, OffloadingConnector and TieringOffloadingManager, with kvtriton's worker ranks, on CPU.

Only the model is simulated: for every full GPU block a request computes, each
rank writes a known pattern (seeded by rank, block index and layer) into its
KV blocks, and the engine records which blocks the model computed, so a test
can tell loaded blocks from recomputed ones. Several worker ranks (tensor
parallelism, each holding half of the KV heads) are several worker-side
connectors whose outputs are combined by vLLM's own ``KVOutputAggregator``.
vLLM derives the rank and world size from its parallel config, which a CPU
test cannot set to two ranks, so :func:`make_engine` overrides exactly those
two fields of the ``OffloadingConfig`` each connector builds, and the number of
workers whose completions the scheduler side waits for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
import warnings
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector as connector_module
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager
from vllm_fixtures.requests import EOS, make_request

from kvtriton.integrations._vllm_tiering import KVTritonPrimaryTier
from kvtriton.manager import CPUOffloadingManager
from kvtriton.worker._slab import PageableSlabWarning

TINY_MODEL_DIR = Path(__file__).resolve().parent.parent / "vllm_fixtures" / "tiny_llama"
BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 32
LAYERS = ("layer0", "layer1")
TOTAL_KV_HEADS = 2
HEAD_SIZE = 8
TIERING_SPEC: dict[str, object] = {
    "spec_name": "KVTritonTieringOffloadingSpec",
    "spec_module_path": "kvtriton.integrations.vllm",
}


def kv_spec(world_size: int) -> FullAttentionSpec:
    """One rank's attention spec: the KV heads split evenly over the ranks."""
    return FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=TOTAL_KV_HEADS // world_size, head_size=HEAD_SIZE, dtype=torch.float16
    )


def model_config() -> ModelConfig:
    return ModelConfig(model=str(TINY_MODEL_DIR), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=1024)


def fs_tier(root: Path, **extra: object) -> dict[str, object]:
    """An ``fs`` secondary tier under ``root`` with few threads (the test machine has two cores)."""
    return {"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2, **extra}


@contextlib.contextmanager
def parallel_as(rank: int, world_size: int) -> Generator[None]:
    """Make the connectors built inside see ``rank`` of ``world_size`` (see the module docstring)."""
    # The connector module's own binding is patched (it imported the function by name).
    real: Callable[..., Any] = getattr(connector_module, "build_offloading_config")

    def build(*args: Any, **kwargs: Any) -> Any:
        config = real(*args, **kwargs)
        return dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, rank=rank, world_size=world_size)
        )

    setattr(connector_module, "build_offloading_config", build)
    try:
        yield
    finally:
        setattr(connector_module, "build_offloading_config", real)


@dataclass
class TieredEngine:
    """vLLM's scheduler and one worker-side connector per rank, stepped by hand, with a simulated model."""

    scheduler: Scheduler
    workers: list[OffloadingConnector]
    kvs: list[dict[str, torch.Tensor]]
    """Each rank's layer caches: ``(num_blocks, 2, block_size, heads, head_size)`` (the CPU "GPU")."""
    aggregator: KVOutputAggregator
    computed: list[tuple[str, int]] = field(default_factory=lambda: [])
    """(request, block index) of every full block the model computed, in order."""
    gpu_blocks_seen: dict[str, list[int]] = field(default_factory=lambda: {})
    """Each request's GPU blocks as last seen while it ran (they are freed when it finishes)."""
    load_jobs: list[int] = field(default_factory=lambda: [])
    store_jobs: list[int] = field(default_factory=lambda: [])

    @property
    def tiering(self) -> TieringOffloadingManager:
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        manager = connector.scheduler.manager
        assert isinstance(manager, TieringOffloadingManager)
        return manager

    @property
    def primary(self) -> KVTritonPrimaryTier:
        primary = self.tiering.primary_tier
        assert isinstance(primary, KVTritonPrimaryTier)
        return primary

    @property
    def cpu(self) -> CPUOffloadingManager:
        return self.primary.cpu

    @property
    def fs(self) -> FileSystemTierManager:
        (tier,) = self.tiering.secondary_tiers
        assert isinstance(tier, FileSystemTierManager)
        return tier

    def gpu_blocks(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    @staticmethod
    def pattern(rank: int, index: int, layer: str, shape: torch.Size) -> torch.Tensor:
        generator = torch.Generator().manual_seed(10_000 * rank + 100 * index + LAYERS.index(layer))
        values = torch.randint(-(2**15), 2**15, shape, generator=generator, dtype=torch.int32)
        return values.to(torch.int16).view(torch.float16)

    def expected_bytes(self, rank: int, index: int) -> list[bytes]:
        """What the model writes into ``rank``'s layers for prompt block ``index``."""
        return [self.pattern(rank, index, name, self.kvs[rank][name][0].shape).numpy().tobytes() for name in LAYERS]

    def block_bytes(self, rank: int, block: int) -> list[bytes]:
        return [self.kvs[rank][name][block].numpy().tobytes() for name in LAYERS]

    def scrub(self) -> None:
        """Overwrite every rank's GPU KV blocks."""
        for kv in self.kvs:
            for tensor in kv.values():
                tensor.fill_(-1.0)

    def _compute(self, output: SchedulerOutput) -> None:
        for request_id, scheduled in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            # schedule() already advanced num_computed_tokens past this step's tokens.
            start, end = request.num_computed_tokens - scheduled, request.num_computed_tokens
            blocks = self.gpu_blocks(request_id)
            for index in range(-(-start // BLOCK_SIZE), end // BLOCK_SIZE):
                self.computed.append((request_id, index))
                for rank, kv in enumerate(self.kvs):
                    for name in LAYERS:
                        kv[name][blocks[index]].copy_(self.pattern(rank, index, name, kv[name][0].shape))

    def step(self) -> SchedulerOutput:
        """One engine step: schedule, every rank's connector around the simulated forward, aggregate, update."""
        output = self.scheduler.schedule()
        for request_id in self.scheduler.requests:
            self.gpu_blocks_seen[request_id] = self.gpu_blocks(request_id)
        metadata = output.kv_connector_metadata
        assert isinstance(metadata, OffloadingConnectorMetadata)
        self.load_jobs += list(metadata.load_jobs)
        self.store_jobs += list(metadata.store_jobs)
        for worker in self.workers:
            worker.handle_preemptions(metadata)
            worker.bind_connector_metadata(metadata)
            worker.start_load_kv(None)  # pyright: ignore[reportArgumentType] -- the offloading connector ignores the forward context
        self._compute(output)
        running = self.scheduler.running
        rank_outputs: list[ModelRunnerOutput | None] = []
        for worker in self.workers:
            if output.total_num_scheduled_tokens > 0:
                worker.wait_for_save()
            sending, receiving = worker.get_finished(output.finished_req_ids)
            worker_meta = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            rank_outputs.append(
                ModelRunnerOutput(
                    req_ids=[request.request_id for request in running],
                    req_id_to_index={request.request_id: index for index, request in enumerate(running)},
                    sampled_token_ids=[[EOS] for _ in running],
                    kv_connector_output=KVConnectorOutput(
                        finished_sending=sending, finished_recving=receiving, kv_connector_worker_meta=worker_meta
                    ),
                )
            )
        combined = self.aggregator.aggregate(rank_outputs)
        assert combined is not None
        self.scheduler.update_from_output(output, combined)
        return output

    def step_until(self, done: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
        """Step with short sleeps until ``done()``: the fs tier answers lookups and copies on its own threads."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
            self.step()
            time.sleep(0.005)

    def serve(self, request_id: str, prompt: list[int]) -> None:
        """Add a request and step until it finished and every transfer it caused (stores, cascades) completed."""
        self.scheduler.add_request(make_request(request_id, prompt))
        self.step_until(lambda: request_id not in self.scheduler.requests, f"{request_id} finished")
        self.step_until(
            lambda: self.cpu.stats().pending == 0 and not self.tiering.has_pending_work(), "transfers drained"
        )

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()


def make_engine(
    config: ModelConfig, extra_config: dict[str, object], *, world_size: int = 1, engine_id: str | None = None
) -> TieredEngine:
    """A scheduler (seeing ``world_size`` ranks) and ``world_size`` worker-side connectors sharing one region."""
    spec = kv_spec(world_size)
    vllm_config = VllmConfig(
        model_config=config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=engine_id or f"tiering-test-{uuid.uuid4().hex[:12]}",
            kv_connector_extra_config={**TIERING_SPEC, **extra_config},
        ),
        device_config=DeviceConfig("cpu"),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_GPU_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)]
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
    with parallel_as(0, world_size):
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
        )
    connector = scheduler.connector
    assert isinstance(connector, OffloadingConnector)
    # The scheduler side counts one completion per worker of its parallel config (1 here).
    connector.scheduler.config = connector.scheduler.config._replace(num_workers=world_size)
    workers: list[OffloadingConnector] = []
    kvs: list[dict[str, torch.Tensor]] = []
    for rank in range(world_size):
        with parallel_as(rank, world_size):
            worker = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        # FlashInfer-style (num_blocks, 2, block_size, heads, dim) layer caches, as a CPU "GPU".
        kv = {
            name: torch.zeros(NUM_GPU_BLOCKS, 2, BLOCK_SIZE, spec.num_kv_heads, HEAD_SIZE, dtype=torch.float16)
            for name in LAYERS
        }
        with set_current_vllm_config(vllm_config), warnings.catch_warnings():
            warnings.simplefilter("ignore", PageableSlabWarning)
            worker.register_kv_caches(kv)
        workers.append(worker)
        kvs.append(kv)
    return TieredEngine(scheduler=scheduler, workers=workers, kvs=kvs, aggregator=KVOutputAggregator(world_size))
